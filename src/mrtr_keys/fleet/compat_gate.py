"""The one fleet check before a change writes a ring feature that older releases cannot read.

The ring reader is strict (`mrtr_keys.ring.document`): an instance that meets a key state or a key
format it does not know refuses the whole ring, logs it, and keeps serving on the ring it had. A change
that writes such a feature (a ``revoked`` key, an ``mk2`` key) would therefore leave those instances on
the old ring, the opposite of what it meant. So it first reads the presence rows of the ring's live
instances (`mrtr_keys.fleet.gates.live_instances`; each row carries the instance's package version) and
refuses (`NotYet`, exit 75) while one of them runs a release older than `mrtr_keys.ring.compat.READS_SINCE`
says the feature needs, naming them; ``--force`` writes anyway and the change is recorded as forced.
An instance with no version in its row counts as too old (`mrtr_keys.ring.compat.can_read`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Literal

from mrtr_keys.audit.writing.stores.base import AuditStore
from mrtr_keys.errors import NotYet
from mrtr_keys.fleet.gates import live_instances
from mrtr_keys.fleet.instances import InstanceRecord
from mrtr_keys.ring.compat import READS_SINCE, can_read, features_of, release
from mrtr_keys.ring.model import KeyRing

if TYPE_CHECKING:
    from mrtr_keys.keystores import Keystore

ReadersCheck = Callable[[KeyRing, KeyRing, datetime], None]
"""``check(before, after, now)`` (`mrtr_keys.changes.apply.ChangeCheck`): raises `NotYet` when `after` holds a
feature `before` did not and a live instance cannot read it."""


@dataclass(frozen=True)
class Unreadable:
    """A live instance and the features (names in `READS_SINCE`) its release does not read."""

    instance: InstanceRecord
    features: tuple[str, ...]

    def describe(self) -> str:
        """``NAME (version 0.1.4, cannot read: key state revoked)``."""
        return (
            f"{self.instance.name} (version {self.instance.version or 'not reported'}, "
            f"cannot read: {', '.join(self.features)})"
        )


def instances_that_cannot_read(
    store: AuditStore | None, ring: KeyRing, features: Iterable[str], now: datetime, *, window: float | None = None
) -> list[Unreadable]:
    """The live instances of `ring` (same ``ring_id``) whose release cannot read one of `features`.

    Without a `store` (auditing off: no presence) nothing is known, and the list is empty.

    Raises:
        KeyError: a feature not in `READS_SINCE` (a programming error).
        AuditError: the store cannot be read.
    """
    wanted = tuple(features)
    for feature in wanted:
        READS_SINCE[feature]  # a name not registered is a bug (KeyError), not an old instance
    if store is None or not wanted:
        return []
    out = []
    for rec in live_instances(store, ring, now, window):
        missing = tuple(f for f in wanted if not can_read(rec.version, f))
        if missing:
            out.append(Unreadable(rec, missing))
    return out


def refuse_unreadable(
    store: AuditStore | None,
    ring: KeyRing,
    features: Iterable[str],
    now: datetime,
    *,
    force: bool = False,
    what: str = "this change",
    instead: str = "override with --force",
) -> str | None:
    """Refuse `what` while a live instance cannot read one of `features` (see the module docstring);
    `instead` is the way around waiting for the upgrade the message offers (e.g. ``make an mk1 key:
    --key-format mk1``).

    Returns:
        None when every live instance reads them; with `force`, a note naming those that do not (the
        caller records the change as forced).

    Raises:
        NotYet: such an instance is live and `force` is not set (exit 75); the message names each, with
            its version and the release it needs.
        AuditError: the store cannot be read.
    """
    old = instances_that_cannot_read(store, ring, features, now)
    if not old:
        return None
    names = "; ".join(u.describe() for u in old)
    needs = ", ".join(sorted({f"{f} needs {READS_SINCE[f]}" for u in old for f in u.features}))
    newest = max((READS_SINCE[f] for u in old for f in u.features), key=lambda v: release(v) or (0, 0, 0))
    if force:
        return f"--force wrote it although {len(old)} live instance(s) cannot read it: {names}"
    raise NotYet(
        f"{what} not written: {len(old)} live instance(s) run a release that cannot read it ({needs}) and would "
        f"keep serving on the ring they have: {names}. Upgrade them first (a rolling restart on mrtr-keys "
        f"{newest} or later; docs/rotation.md, 'Upgrading the fleet'), or {instead}",
        waits=[{"for": "instances", "seconds": None, "detail": names}],
    )


def readers_check_for(
    keystore: Keystore, *, audit: str | Literal[False] | None = None, what: str = "this change", instead: str
) -> ReadersCheck | None:
    """The check `mrtr_keys.changes.apply.apply_change` runs before it saves (``check=``): `refuse_unreadable`
    over the features the new ring holds and the old one did not (`mrtr_keys.ring.compat.features_of`), in the
    presence store of the ring in `keystore` (as `mrtr_keys.fleet.gates.rotation_gate_for` finds it). None when
    there is no store to read (auditing off: no presence, nothing known).

    Raises:
        ConfigError: a bad store URL; AuditError: the store cannot be opened.
    """
    from mrtr_keys.audit.writing.stores.url import existing_store

    store = existing_store(keystore, audit=audit)
    if store is None:
        return None

    def check(before: KeyRing, after: KeyRing, now: datetime) -> None:
        added = features_of(after) - features_of(before)
        if added:
            refuse_unreadable(store, after, sorted(added), now, what=what, instead=instead)

    return check
