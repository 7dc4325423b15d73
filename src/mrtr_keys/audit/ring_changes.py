"""Key ring changes as audit events: `change_listener()` is a `mrtr_keys.changes.apply.ChangeListener`.

Pass it to any change (``run_step(..., listeners=[change_listener()])``, ``create_ring``,
``mrtr_keys.changes.scope.add``/``remove``, ``rewrap``) to get the records the CLI writes.

Each saved change (``init``, ``begin``, ``promote``, ``retire``, ``rewrap``, ``audience``) becomes
one event, written synchronously: ``kid`` is the key the step is about (the new key for init,
begin and promote, the old one for retire), ``generation`` the ring's generation after the
change, ``reason`` is ``forced`` for a step run with ``--force`` past a gate (or ``added`` /
``removed`` for an audience change, whose name is in ``audience``; ``sdk-v1`` for an ``init`` from
the MCP SDK's keys, `mrtr_keys.changes.create.create_ring_from_sdk_keys`). A ``revoke`` names the revoked
key, and its ``reason`` is the operator's ``--reason`` text (``forced; TEXT`` past a fleet check).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

from mrtr_keys.audit.events import FORCED, AuditEvent, format_ts, instance_id
from mrtr_keys.errors import AuditError, AuditUnavailable

if TYPE_CHECKING:
    from mrtr_keys.changes.apply import ChangeListener, ChangeResult
    from mrtr_keys.keystores import Keystore
    from mrtr_keys.ring.model import KeyRing


RECORD_PATIENCE = 15.0
"""Seconds a saved change keeps trying to record itself while the store is unavailable (a write cut
at the store's deadline, a reset, a failover): the change is already saved, and a record lost for a
store that was only slow (a PostgreSQL checkpoint stalling commits for seconds) is worse than a CLI
that waits. Each retry re-sends the same event, stored once whether or not the cut one landed
(`mrtr_keys.audit.writing.direct.DirectWriter.append`)."""


def change_event(result: ChangeResult, now: float | None = None) -> AuditEvent:
    """The audit event for one saved change, at `now`, else when the keystore's save returned, else now."""
    details = result.details
    op = result.op
    audience: str | None = None
    reason: str | None = FORCED if result.forced else None
    if op == "retire":
        kid = details.get("old")
    elif op in ("abort", "destroy"):  # the key removed or destroyed
        kid = details.get("removed") or details.get("kid")
    elif op == "revoke":  # the revoked key, and why (a new primary, if any, is in the ring-loaded events)
        kid = details.get("kid")
        why = str(details.get("reason") or "")
        reason = f"{FORCED}; {why}" if result.forced else why
    elif op == "audience":
        kid = None
        if "added" in details:
            audience, reason = str(details["added"]), reason or "added"
        elif "removed" in details:
            audience, reason = str(details["removed"]), reason or "removed"
    elif op == "rewrap":
        rewrapped = details.get("rewrapped") or []
        kid = ",".join(str(k) for k in rewrapped) or None
    else:
        kid = details.get("new") or result.ring.primary.kid
        if op == "init" and details.get("format") == "sdk-v1":
            reason = reason or "sdk-v1"  # a ring started from the MCP SDK's keys (docs/migration.md)
    return AuditEvent(
        time=format_ts(now if now is not None else result.saved_at or time.time()),
        instance=instance_id(),
        op=op,
        kid=None if kid is None else str(kid),
        audience=audience,
        reason=reason,
        generation=result.ring.generation,
    )


def change_listener(audit: str | Literal[False] | None = None) -> ChangeListener:
    """A listener recording every saved change in the store `audit` names (see
    `mrtr_keys.audit.writing.stores.url.resolve_url`; None: ``MRTR_KEYS_AUDIT`` else beside the ring).

    The listener raises `AuditError` if the store cannot be written (the change itself is
    already saved; the message says so): at once if the store refused the write, after trying for
    up to `RECORD_PATIENCE` seconds if it was unavailable.
    """

    def listener(result: ChangeResult, before: KeyRing, keystore: Keystore) -> None:
        # Imported on the first change, not when the CLI installs the listener at start-up.
        from mrtr_keys.audit.capture.registry import shared_sink
        from mrtr_keys.audit.writing.stores.url import resolve_url

        url = resolve_url(audit, keystore.directory)
        if url is None:
            return
        event = change_event(result)
        give_up = time.monotonic() + RECORD_PATIENCE
        delay = 0.2
        try:
            while True:
                try:
                    shared_sink(url, keystore.directory).write_now([event])
                    break
                except AuditUnavailable:
                    if time.monotonic() + delay > give_up:
                        raise
                    time.sleep(delay)
                    delay = min(delay * 2, 2.0)
        except AuditError as exc:
            raise AuditError(
                f"the {result.op} was saved (generation {result.ring.generation}) but not recorded in the "
                f"audit log: {exc}"
            ) from None

    return listener
