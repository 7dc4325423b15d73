"""Applying one change to a stored key ring: lock, load, transform, let the backend react, CAS-save.

Every command that changes a ring (rotation steps, audience scope, rewrap)
goes through `apply_change`, so each change is one generation, serialised
against cooperating writers by the keystore lock and protected against any
other writer by compare-and-swap. If anything fails before the save, the
stored ring is unchanged.

After a change is saved, each of the `listeners` the caller passes is called with it. Nothing is
registered globally: the CLI passes the audit log's listener, and a library user who wants the
same audit records passes it too::

    from mrtr_keys.audit.ring_changes import change_listener
    run_step(store, "begin", listeners=[change_listener()])  # recorded like `mrtr-keys rotate begin`
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import mrtr_keys.tracing as tracing
from mrtr_keys.backends import backend_for
from mrtr_keys.errors import MrtrKeysError
from mrtr_keys.keystores import Keystore
from mrtr_keys.ring.model import KeyRing, utcnow


@dataclass(frozen=True)
class ChangeResult:
    """What a change did. `changed` is False for an idempotent re-run (nothing written)."""

    op: str
    changed: bool
    ring: KeyRing
    message: str
    forced: bool = False
    details: dict[str, Any] = field(default_factory=dict)
    saved_at: float | None = None
    """POSIX time the keystore's save returned (when the keystore shows the change); None if nothing was saved."""


Transform = Callable[[KeyRing, datetime], ChangeResult]
"""Pure step: given the stored ring and the time, say what the new ring is (or that nothing changes)."""

ChangeCheck = Callable[[KeyRing, KeyRing, datetime], None]
"""Called as ``check(before, after, now)`` before a change is saved; raises to refuse it (nothing is written),
e.g. `mrtr_keys.fleet.compat_gate.refuse_unreadable` while a live instance cannot read the new ring."""

ChangeListener = Callable[[ChangeResult, KeyRing, Keystore], None]
"""Called as ``listener(result, before, keystore)`` after a change is saved (e.g.
`mrtr_keys.audit.ring_changes.change_listener`); not called when nothing changed."""


def notify(listeners: Sequence[ChangeListener], result: ChangeResult, before: KeyRing, keystore: Keystore) -> None:
    """Call every listener with a saved change, in order (a listener's exception propagates: the
    change is already saved, so the message must say so, as the audit listener's does)."""
    for listener in listeners:
        listener(result, before, keystore)


def apply_change(
    keystore: Keystore,
    op: str,
    transform: Transform,
    *,
    now: datetime | None = None,
    listeners: Sequence[ChangeListener] = (),
    check: ChangeCheck | None = None,
) -> ChangeResult:
    """Run `transform` on the stored ring and save the result as the next generation; then call `listeners`.
    `check`, if given, sees the ring before and after (once the backend reacted) and may refuse the change.

    Raises:
        KeyRingNotFound, KeystoreError, KeyRingError: the ring cannot be loaded.
        ConflictError: another writer saved first (nothing written).
        RotationError, NotYet, ConfigError: raised by `transform` or `check`; nothing written.
        BackendUnavailable: the backend could not react (nothing written).
    """
    now = now or utcnow()
    with tracing.span("mrtr_keys.ring.change", op=op, keystore=keystore.url) as sp:
        try:
            with keystore.locked():
                before = tracing.load_ring(keystore)
                result = transform(before, now)
                if not result.changed:
                    tracing.set_attributes(sp, op=result.op, outcome="unchanged", generation=before.generation)
                    return result
                after = backend_for(before.codec).apply(result.op, before, result.ring)
                if check is not None:
                    check(before, after, now)
                keystore.save(after, expected_generation=before.generation)
                saved_at = time.time()
        except MrtrKeysError as exc:
            tracing.set_attributes(sp, outcome="refused", reason=type(exc).__name__)
            raise
        saved = ChangeResult(
            op=result.op,
            changed=True,
            ring=after,
            message=result.message,
            forced=result.forced,
            details=result.details,
            saved_at=saved_at,
        )
        kid = result.details.get("new") or result.details.get("kid") or result.details.get("removed")
        tracing.set_attributes(
            sp,
            op=result.op,
            outcome="changed",
            generation=after.generation,
            kid=str(kid) if kid else None,
            reason="forced" if result.forced else None,
        )
    notify(listeners, saved, before, keystore)
    return saved
