"""The one fleet check before writing a ring a live instance could not read (`mrtr_keys.ring.compat`).

The ring reader is strict: an instance that meets a ring feature it does not know (a key format, a key
state) refuses the whole ring and keeps serving the one it had, so it would stop following the fleet. A
change that adds such a feature (``rotate begin`` making the first ``mk2`` key, ...) therefore looks at
the presence rows first and is refused (`NotYet`, exit 75) while a live instance of the ring reports a
release that cannot read it, naming each with its version. Stale and stopped instances do not count (as
for the rotation gates, `mrtr_keys.fleet.gates`); nor does a store with no presence (auditing off).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Literal

from mrtr_keys.errors import NotYet
from mrtr_keys.fleet.presence import LIVE, InstanceRecord, read_instances
from mrtr_keys.ring.compat import READS_SINCE, can_read, features_of
from mrtr_keys.ring.model import KeyRing

if TYPE_CHECKING:
    from mrtr_keys.audit.stores.base import AuditStore
    from mrtr_keys.keystores import Keystore

ReadersCheck = Callable[[KeyRing, KeyRing, datetime], None]
"""``check(before, after, now)``: raises `NotYet` when `after` holds a feature a live instance cannot read."""


def instances_that_cannot_read(
    store: AuditStore, ring_id: str, features: Iterable[str], now: datetime
) -> list[tuple[InstanceRecord, str]]:
    """Each live instance of ring `ring_id` in `store` that cannot read one of `features`, with the first
    such feature (an instance that reports no version counts as too old: `can_read`).

    Raises:
        AuditError: the store cannot be read.
    """
    wanted = sorted(features)
    at = now.timestamp()
    out: list[tuple[InstanceRecord, str]] = []
    for rec in read_instances(store):
        if rec.ring_id != ring_id or rec.status(at) != LIVE:
            continue
        missing = next((f for f in wanted if not can_read(rec.version, f)), None)
        if missing is not None:
            out.append((rec, missing))
    return out


def refuse_unreadable(
    store: AuditStore, before: KeyRing, after: KeyRing, now: datetime, *, alternative: str | None = None
) -> None:
    """Raise `NotYet` if `after` holds a feature `before` did not and a live instance cannot read it.

    `alternative` (e.g. ``make an mk1 key instead: mrtr-keys rotate begin --key-format mk1``) is added to
    the message as the way around waiting for the upgrade.

    Raises:
        NotYet: naming each such instance, its version and the first release that reads the feature.
        AuditError: the store cannot be read.
    """
    added = features_of(after) - features_of(before)
    if not added:
        return
    old = instances_that_cannot_read(store, after.ring_id, added, now)
    if not old:
        return
    names = "; ".join(
        f"{r.name} (mrtr-keys {r.version or 'of unknown version'}, needs {READS_SINCE[f]} for {f})" for r, f in old
    )
    message = (
        f"{len(old)} live instance(s) of this key ring run a release that cannot read the ring this change writes "
        f"(they would refuse it and stop following rotations): {names}. Upgrade them first (docs/rotation.md, "
        "'Upgrading the fleet')"
    )
    if alternative:
        message += f", or {alternative}"
    raise NotYet(message, waits=[{"for": "upgrade", "seconds": None, "detail": names}])


def readers_check_for(
    keystore: Keystore, *, audit: str | Literal[False] | None = None, alternative: str | None = None
) -> ReadersCheck | None:
    """`refuse_unreadable` over the presence store of the ring in `keystore` (see
    `mrtr_keys.fleet.gates.rotation_gate_for`), or None when there is none to read; `alternative` as there.

    Raises:
        ConfigError: a bad store URL; AuditError: the store cannot be opened.
    """
    from mrtr_keys.audit.stores.url import existing_store

    store = existing_store(keystore, audit=audit)
    if store is None:
        return None

    def check(before: KeyRing, after: KeyRing, now: datetime) -> None:
        refuse_unreadable(store, before, after, now, alternative=alternative)

    return check
