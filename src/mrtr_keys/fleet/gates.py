"""Rotation gates read from the audit store: presence (`mrtr_keys.fleet.presence`) and the event log.

* **promote** (and ``next`` when it would promote): refused while a *live* instance of this ring
  (heartbeat younger than 3 of its intervals, not stopped) has not loaded the generation `begin`
  wrote: promoting would let the new key seal tokens that instance cannot verify.
* **retire** (and ``next`` when it would retire): refused while a live instance has not loaded the
  generation `promote` wrote (it still seals with the old key), or while the log shows the old kid
  *sealing* within the last TTL (tokens it sealed stay valid for a TTL). The time gate (promote +
  TTL + 60 s) lives in `mrtr_keys.changes.rotation`; `evaluate` reports it too, as ``TTL``.

A live instance whose ring watcher is stuck (its note says ``watcher stuck since ...``) counts as not
having loaded anything newer than it reports, and holds both gates until it checks again (issue 22).

A crashed instance stops counting once its heartbeat is stale; a stopped one (clean shutdown) at
once, so a restarted fleet does not hold promote back under its old names. Refusals raise `NotYet`
(exit 75) naming the instances. ``--force`` overrides; so does a narrowed ``--window SECONDS``
(count an instance only if its heartbeat is younger than that), and either is recorded with reason
``forced``. `rotation_gate` gives the callable `mrtr_keys.changes.rotation.run_step` takes as ``gate=``;
`rotation_gate_for` picks the store of a key ring (what ``mrtr-keys rotate`` uses).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from mrtr_keys.audit.events import format_dt, parse_event_time
from mrtr_keys.audit.writing.stores.base import AuditStore, Query
from mrtr_keys.errors import NotYet
from mrtr_keys.fleet.presence import LIVE, InstanceRecord, read_instances
from mrtr_keys.ring.model import KeyRing

if TYPE_CHECKING:
    from mrtr_keys.keystores import Keystore

Gate = Callable[[str, KeyRing, datetime], "str | None"]
"""``gate(step, ring, now)``: raises `NotYet` to refuse; returns a note when it passed only thanks to an
override (the step is then recorded as forced), else None."""

TTL, INSTANCES, SEALING = "TTL", "instances", "old key sealing"


@dataclass(frozen=True)
class Wait:
    """One thing a step waits for: `what` (`TTL`, `INSTANCES`, `SEALING`), `seconds` (None: until the
    instances act) and a sentence saying why."""

    what: str
    seconds: float | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        seconds = None if self.seconds is None else round(self.seconds, 3)
        return {"for": self.what, "seconds": seconds, "detail": self.detail}


@dataclass(frozen=True)
class GateReport:
    """What the next step of a ring waits for at one moment."""

    step: str
    target: int | None
    """The generation every live instance must have loaded (None: the step waits for none)."""
    live: list[InstanceRecord] = field(default_factory=list)
    lagging: list[InstanceRecord] = field(default_factory=list)
    waits: list[Wait] = field(default_factory=list)

    @property
    def wait_seconds(self) -> float:
        """The longest known wait in seconds (0 when nothing with a known end is waited for)."""
        return max((w.seconds for w in self.waits if w.seconds is not None), default=0.0)

    @property
    def ready(self) -> int:
        return len(self.live) - len(self.lagging)

    def blocking(self) -> list[Wait]:
        """The waits the audit gate enforces (the TTL is `mrtr_keys.changes.rotation`'s)."""
        return [w for w in self.waits if w.what != TTL]


def _generation_of(store: AuditStore | None, op: str, kid: str | None, fallback: int) -> int:
    if kid is None or store is None:
        return fallback
    found = store.query(Query(op=op, kid=kid, newest_first=True, limit=1))
    if found and found[0].event.generation is not None:
        return found[0].event.generation
    return fallback


def phase1_generation(store: AuditStore | None, ring: KeyRing, new_kid: str) -> int:
    """The generation `begin` wrote for `new_kid` (from its audit event), else the ring's current one."""
    return _generation_of(store, "begin", new_kid, ring.generation)


def live_instances(
    store: AuditStore, ring: KeyRing, now: datetime, window: float | None = None
) -> list[InstanceRecord]:
    """Instances of `ring` (same ``ring_id``) that are live at `now`; with `window`, only those whose
    last heartbeat is also younger than `window` seconds."""
    at = now.timestamp()
    out = []
    for rec in read_instances(store):
        if rec.ring_id != ring.ring_id or rec.status(at) != LIVE:
            continue
        if window is not None and rec.age(at) >= window:
            continue
        out.append(rec)
    return out


def sealing_wait(
    store: AuditStore, ring: KeyRing, old_kid: str, now: datetime, *, since: datetime | None = None
) -> Wait | None:
    """A `SEALING` wait if the log shows `old_kid` sealing within the ring's TTL before `now` and after
    `since` (the promote: a seal before it expires before the TTL gate, promote + TTL + 60 s, opens, so
    only a seal after it can make retire wait longer, and only such a seal says an instance lags)."""
    ttl = ring.ttl_seconds
    start = now - timedelta(seconds=ttl)
    if since is not None and since > start:
        start = since
    last = store.query(Query(op="seal", kid=old_kid, outcome="ok", since=format_dt(start), newest_first=True, limit=1))
    if not last:
        return None
    rec = last[0]
    until = parse_event_time(rec.event.time) + timedelta(seconds=ttl)
    wait = max(0.0, (until - now).total_seconds())
    after = " after the promote" if since is not None else ""
    return Wait(
        SEALING,
        wait,
        f"the audit log shows {old_kid} still sealing{after} (last at {rec.event.time}, instance "
        f"{rec.event.instance}); tokens it sealed stay valid for the TTL ({ttl:g} s), so retiring now would reject "
        f"them: {math.ceil(wait)} s more, until {format_dt(until)}, and longer if it keeps sealing",
    )


def evaluate(store: AuditStore | None, ring: KeyRing, now: datetime, *, window: float | None = None) -> GateReport:
    """What the ring's next step waits for at `now` (see the module docstring); `window` narrows liveness.
    Without a `store` only the TTL is known."""
    from mrtr_keys.changes.rotation import Phase, status

    st = status(ring, now)
    if st.phase is Phase.IDLE:
        return GateReport("begin", None)
    if st.phase is Phase.BEGUN:
        assert st.new is not None
        step, target = "promote", phase1_generation(store, ring, st.new.kid)
    else:
        step, target = "retire", _generation_of(store, "promote", st.new.kid if st.new else None, ring.generation)
    live = live_instances(store, ring, now, window) if store is not None else []
    # A stuck watcher loads nothing newer: such an instance holds promote (it will not learn the new key)
    # and retire (it would keep opening tokens of the retired key) whatever generation it reports.
    lagging = [r for r in live if r.generation is None or r.generation < target or r.watcher_stuck]
    waits: list[Wait] = []
    if lagging:
        names = "; ".join(
            f"{r.name} (generation {r.generation}, heartbeat {math.floor(r.age(now.timestamp()))} s ago"
            + (f", {r.note}" if r.note else "")
            + ")"
            for r in lagging
        )
        waits.append(
            Wait(
                INSTANCES,
                None,
                f"{len(lagging)} of {len(live)} live instance(s) have not loaded generation {target}"
                + (" or have a stuck ring watcher" if any(r.watcher_stuck for r in lagging) else "")
                + f": {names}",
            )
        )
    if step == "retire":
        if st.wait_seconds > 0 and st.retire_at is not None:
            waits.append(
                Wait(
                    TTL,
                    st.wait_seconds,
                    f"promote + TTL {ring.ttl_seconds:g} s + 60 s, until {format_dt(st.retire_at)}",
                )
            )
        if st.old is not None and store is not None:
            promoted = ring.primary.promoted_at or ring.primary.created_at
            sealing = sealing_wait(store, ring, st.old.kid, now, since=promoted)
            if sealing is not None:
                waits.append(sealing)
    return GateReport(step, target, live, lagging, waits)


def _refusal(report: GateReport) -> NotYet:
    """The one refusal of a gated step: every closed gate with its own wait, and the longest as `wait_seconds`
    (the same list and maximum `evaluate` gives ``rotate status``)."""
    why = {
        "promote": "promoting now would let the new key seal tokens they cannot verify",
        "retire": "they still seal with the old key",
    }.get(report.step, "")
    parts = []
    for w in report.waits:
        if w.what == INSTANCES:
            parts.append(
                f"{w.detail}; {why}. Live instances load it by themselves within seconds; one that crashed stops "
                "counting 3 heartbeats after its last"
            )
        elif w.what == SEALING:
            advice = ". Make the lagging instance reload the key ring" if report.lagging else ""
            parts.append(f"{w.detail}{advice}")
        else:
            parts.append(f"the TTL gate ({w.detail}): {math.ceil(w.seconds or 0)} s more")
    known = [w.seconds for w in report.waits if w.seconds is not None]
    longest = max(known) if known else None
    head = f"{report.step} not yet"
    if longest is not None:
        head += f" (at least {math.ceil(longest)} s more: " + ", ".join(_named(w) for w in report.waits) + ")"
    return NotYet(
        head + ": " + "; and ".join(parts) + ". Wait (--wait DURATION) or override with --force",
        wait_seconds=longest,
        waits=[w.to_json() for w in report.waits],
    )


def _named(w: Wait) -> str:
    return f"{w.what} {math.ceil(w.seconds)} s" if w.seconds is not None else f"{w.what} until they load it"


def rotation_gate(store: AuditStore, *, window: float | None = None) -> Gate:
    """The ``gate=`` for `mrtr_keys.changes.rotation.run_step`: runs the check for `step` (``promote`` or
    ``retire``; other steps pass) and raises `NotYet` to refuse. A `window` that lets a refused step
    pass is an override: the gate then returns a note and the step is recorded as forced."""

    def gate(step: str, ring: KeyRing, now: datetime) -> str | None:
        if step not in ("promote", "retire"):
            return None
        report = evaluate(store, ring, now)
        if report.step != step or not report.blocking():
            return None
        if window is not None:
            narrowed = evaluate(store, ring, now, window=window)
            if not narrowed.blocking():
                names = ", ".join(r.name for r in report.lagging)
                return f"--window {window:g} left out instance(s) that had not loaded the ring: {names}"
        raise _refusal(report)

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
    from mrtr_keys.audit.writing.stores.url import existing_store

    store = existing_store(keystore, audit=audit)
    return None if store is None else rotation_gate(store, window=window)


def describe(report: GateReport, ring: KeyRing, now: datetime) -> str:
    """The rotation's state in one sentence, e.g. ``promoted at 13:02Z; retire possible in 39 s, at
    13:25:55Z; waiting for: TTL``."""
    from mrtr_keys.changes.rotation import Phase, status

    st = status(ring, now)
    if st.phase is Phase.IDLE:
        return f"idle: {ring.primary.kid} seals; begin possible now"
    if st.phase is Phase.BEGUN:
        assert st.new is not None
        head = f"begun at {_hm(st.new.created_at)} ({st.new.kid} verifies)"
    else:
        head = f"promoted at {_hm(ring.primary.promoted_at or ring.primary.created_at)} ({ring.primary.kid} seals)"
    if not report.waits:
        return f"{head}; {report.step} possible now"
    wait = report.wait_seconds
    names = []
    for w in report.waits:
        if w.what == INSTANCES:
            names.append(f"instances ({', '.join(r.name for r in report.lagging)})")
        elif w.seconds is not None and len(report.waits) > 1:
            names.append(f"{w.what} ({math.ceil(w.seconds)} s)")
        else:
            names.append(w.what)
    if all(w.seconds is None for w in report.waits):
        when = f"{report.step} possible once {report.ready} of {len(report.live)} ready becomes all"
    else:
        at = (now + timedelta(seconds=wait)).strftime("%H:%M:%SZ")
        when = f"{report.step} possible in {math.ceil(wait)} s, at {at}"
        if any(w.seconds is None for w in report.waits):
            when += " at the earliest"
    return f"{head}; {when}; waiting for: {', '.join(names)}"


def _hm(dt: datetime) -> str:
    return dt.strftime("%H:%MZ")
