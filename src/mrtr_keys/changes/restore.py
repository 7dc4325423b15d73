"""Restoring a backup of a key ring: ``mrtr-keys rotate restore FILE``.

Running instances refuse a stored ring with a lower generation than the one they loaded (a backup
put back by hand, in which a retired key would be usable again), so a restore is an explicit step:
the backup's keys, audiences and TTL are written as the stored ring's **next** generation, through
the one compare-and-swap change path, and recorded in the audit log like every change. Only a backup
of the same ring (same ``ring_id`` and codec type) is accepted.

A revocation is final (`mrtr_keys.changes.revoke`), and a backup made before it still holds the key: a restore
keeps every revocation of the stored ring. A key revoked since the backup is written revoked, as the stored ring
has it (without its material); a backup whose primary was revoked since is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from mrtr_keys.changes.apply import ChangeListener, ChangeResult, apply_change
from mrtr_keys.errors import ConfigError
from mrtr_keys.keystores import Keystore
from mrtr_keys.ring.model import Key, KeyRing, KeyState, format_time


def restore(
    keystore: Keystore,
    backup: KeyRing,
    *,
    now: datetime | None = None,
    listeners: Sequence[ChangeListener] = (),
) -> ChangeResult:
    """Write `backup` back as the next generation of the ring in `keystore`; `listeners` as for `apply_change`.

    Raises:
        ConfigError: `backup` is another ring (``ring_id``) or for another codec.
        KeyRingNotFound, KeystoreError, ConflictError: as `apply_change`.
    """

    def transform(ring: KeyRing, at: datetime) -> ChangeResult:
        if backup.ring_id != ring.ring_id:
            raise ConfigError(
                f"the backup is of another key ring (ring_id {backup.ring_id}, stored {ring.ring_id}); "
                "nothing was written"
            )
        if backup.codec.type != ring.codec.type:
            raise ConfigError(
                f"the backup is for the {backup.codec.type!r} codec, the stored ring for {ring.codec.type!r}"
            )
        after = replace(backup, keys=_keep_revocations(ring, backup), generation=ring.generation + 1)
        kids = ", ".join(f"{k.kid} {k.state.value}" for k in after.keys)
        return ChangeResult(
            "restore",
            True,
            after,
            f"restored generation {backup.generation} as generation {after.generation}: {kids}",
            details={"from_generation": backup.generation, "new": after.primary.kid},
        )

    return apply_change(keystore, "restore", transform, now=now, listeners=listeners)


def _keep_revocations(ring: KeyRing, backup: KeyRing) -> tuple[Key, ...]:
    """`backup`'s keys with every key `ring` holds as revoked written as `ring` has it (appended when the backup
    does not have it, so its tokens still say ``revoked kid``).

    Raises:
        ConfigError: the backup's primary was revoked since (nothing would seal).
    """
    revoked = {k.kid: k for k in ring.keys if k.state is KeyState.REVOKED}
    for k in backup.keys:
        gone = revoked.get(k.kid)
        if gone is not None and k.state is KeyState.PRIMARY:
            raise ConfigError(
                f"the backup's primary {k.kid} was revoked at {format_time(gone.revoked_at)} ({gone.revoked_reason}); "
                "a revocation is final, so this backup cannot be restored: restore one made after it, or rotate on; "
                "nothing was written"
            )
    kept = tuple(revoked.get(k.kid, k) for k in backup.keys)
    return kept + tuple(k for kid, k in revoked.items() if backup.lookup(kid) is None)
