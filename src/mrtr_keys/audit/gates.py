"""Rotation gates read from the audit log that answer "is the old key really unused?".

* **retire** (and ``next`` when it would retire): refused while the log shows the old kid
  *sealing* within the last TTL: some instance still mints tokens with it, and they stay valid
  for a TTL. This holds even once promote + TTL + 60 s have passed (the time gate in
  `mrtr_keys.ring.rotation`): a lagging instance that never reloaded keeps sealing with the old key.
* **promote** (and ``next`` when it would promote): refused while any instance seen in the log
  within `window` seconds (default 10 minutes) has not loaded the phase-1 generation (the ring
  `begin` wrote), according to its ``ring-loaded`` events: promoting would let the new key seal
  tokens that instance cannot verify. Only instances that have loaded a ring (codecs, sidecars)
  count; CLI runs do not.

Both raise `NotYet` (exit 75) naming what they wait for; ``--force`` overrides and the step is
recorded with reason ``forced``. `rotation_gate` gives the callable `mrtr_keys.ring.rotation.run_step`
takes as ``gate=``; `rotation_gate_for` picks the store of a key ring (what ``mrtr-keys rotate`` uses).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Literal

from mrtr_keys.audit.events import OP_RING_LOADED, format_dt, parse_event_time
from mrtr_keys.audit.stores.base import AuditStore, Query
from mrtr_keys.errors import NotYet
from mrtr_keys.ring.model import KeyRing

if TYPE_CHECKING:
    from mrtr_keys.keystores import Keystore

DEFAULT_WINDOW_SECONDS = 600.0
"""An instance counts for the promote gate if it wrote any event this recently (seconds)."""

Gate = Callable[[str, KeyRing, datetime], None]


def check_retire(store: AuditStore, ring: KeyRing, old_kid: str, now: datetime) -> None:
    """Raise `NotYet` if `old_kid` sealed within the ring's TTL before `now`."""
    ttl = ring.ttl_seconds
    since = format_dt(now - timedelta(seconds=ttl))
    last = store.query(Query(op="seal", kid=old_kid, outcome="ok", since=since, newest_first=True, limit=1))
    if not last:
        return
    rec = last[0]
    sealed_at = parse_event_time(rec.event.time)
    until = sealed_at + timedelta(seconds=ttl)
    wait = max(0.0, (until - now).total_seconds())
    raise NotYet(
        f"the audit log shows {old_kid} still sealing (last at {rec.event.time}, instance {rec.event.instance}); "
        f"tokens it sealed stay valid for the TTL ({ttl:g} s), so retiring now would reject them: waiting "
        f"{math.ceil(wait)} s more, until {format_dt(until)}, and longer if it keeps sealing. Make that instance "
        "reload the key ring, or override with --force",
        wait_seconds=wait,
    )


def phase1_generation(store: AuditStore, ring: KeyRing, new_kid: str) -> int:
    """The generation `begin` wrote for `new_kid` (from its audit event), else the ring's current one."""
    began = store.query(Query(op="begin", kid=new_kid, newest_first=True, limit=1))
    if began and began[0].event.generation is not None:
        return began[0].event.generation
    return ring.generation


def lagging_instances(
    store: AuditStore, generation: int, now: datetime, window: float = DEFAULT_WINDOW_SECONDS
) -> list[tuple[str, int, str]]:
    """(instance, newest generation it loaded, last seen) for every instance seen within `window`
    seconds of `now` whose newest ``ring-loaded`` generation is below `generation`."""
    since = format_dt(now - timedelta(seconds=window))
    lagging: list[tuple[str, int, str]] = []
    for instance, _count in store.stats("instance", Query(since=since)):
        if instance is None:
            continue
        loaded = store.query(Query(op=OP_RING_LOADED, instance=instance, newest_first=True, limit=1))
        if not loaded or loaded[0].event.generation is None:
            continue  # not a codec (a CLI run, say): it seals nothing
        gen = loaded[0].event.generation
        if gen < generation:
            seen = store.query(Query(instance=instance, newest_first=True, limit=1))
            lagging.append((instance, gen, seen[0].event.time if seen else loaded[0].event.time))
    return lagging


def check_promote(
    store: AuditStore, ring: KeyRing, new_kid: str, now: datetime, window: float = DEFAULT_WINDOW_SECONDS
) -> None:
    """Raise `NotYet` if an instance seen within `window` seconds has not loaded phase 1."""
    generation = phase1_generation(store, ring, new_kid)
    lagging = lagging_instances(store, generation, now, window)
    if not lagging:
        return
    names = ", ".join(f"{inst} (generation {gen}, last seen {seen})" for inst, gen, seen in lagging)
    newest_seen = max(parse_event_time(seen) for _, _, seen in lagging)
    wait = max(0.0, (newest_seen + timedelta(seconds=window) - now).total_seconds())
    raise NotYet(
        f"{len(lagging)} instance(s) seen in the last {window:g} s have not loaded generation {generation}, "
        f"so they cannot verify {new_kid} yet: {names}. Reload them (or let them stop: an instance stops "
        f"counting {window:g} s after its last event), or override with --force",
        wait_seconds=wait,
    )


def rotation_gate(store: AuditStore, *, window: float = DEFAULT_WINDOW_SECONDS) -> Gate:
    """The ``gate=`` for `mrtr_keys.ring.rotation.run_step`: ``gate(step, ring, now)`` runs the check for
    `step` (``promote`` or ``retire``; other steps pass) and raises `NotYet` to refuse."""
    from mrtr_keys.ring.rotation import Phase, status

    def gate(step: str, ring: KeyRing, now: datetime) -> None:
        st = status(ring, now)
        if step == "promote" and st.phase is Phase.BEGUN and st.new is not None:
            check_promote(store, ring, st.new.kid, now, window)
        elif step == "retire" and st.phase is Phase.PROMOTED and st.old is not None:
            check_retire(store, ring, st.old.kid, now)

    return gate


def rotation_gate_for(
    keystore: Keystore, *, audit: str | Literal[False] | None = None, window: float | None = None
) -> Gate | None:
    """The rotation gate over the audit store of the ring in `keystore` (`audit`, else
    ``MRTR_KEYS_AUDIT``, else ``audit.db`` beside the ring), or None when there is none to read:
    auditing off, or the default SQLite file never written (then only the rotation's time gate applies).

    Raises:
        ConfigError: a bad store URL; AuditError: the store cannot be opened.
    """
    from mrtr_keys.audit.stores.url import existing_store

    store = existing_store(keystore, audit=audit)
    if store is None:
        return None
    return rotation_gate(store, window=DEFAULT_WINDOW_SECONDS if window is None else window)
