"""`mrtr-keys keys revoke KID --reason TEXT`: a leaked key stops working on every instance (`mrtr_keys.changes.revoke`).

Before it writes it prints what it breaks (`mrtr_keys.fleet.revoke_estimate`) and needs ``--yes`` (asked on
a terminal; a run without a terminal and without ``--yes`` exits 2 with the estimate). The estimate it
reports with the result is counted again just before the write, under the keystore lock, so rounds that came
back while the operator read the first one are not counted. It refuses (exit 75)
while a live instance runs a release that cannot read the state ``revoked`` (`mrtr_keys.fleet.compat_gate`),
unless ``--force``. ``--wait DURATION`` then waits until every live instance has loaded the new generation
(`mrtr_keys.fleet.applied`; exit 75 naming those that have not, when the wait runs out).
"""

from __future__ import annotations

import getpass
import os
import socket
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, keystore

if TYPE_CHECKING:
    from mrtr_keys.fleet.applied import Applied

KidArg = Annotated[str, typer.Argument(help="Key id to revoke (8 hex characters, see: mrtr-keys keys list).")]
ReasonOpt = Annotated[
    str, typer.Option("--reason", help="Why (kept in the ring and the audit log), e.g. 'ring file in a backup'.")
]
YesOpt = Annotated[bool, typer.Option("--yes", help="Revoke without asking (required without a terminal).")]
KeepOpt = Annotated[
    bool,
    typer.Option("--keep-material", help="Keep the key's material in the ring (remove it later: keys destroy)."),
]
ForceOpt = Annotated[
    bool,
    typer.Option("--force", help="Write although a live instance runs a release that cannot read a revoked key."),
]
WaitOpt = Annotated[
    str | None,
    typer.Option(
        "--wait",
        metavar="DURATION",
        help="Wait up to DURATION (seconds, or 90s, 15m) until every live instance has loaded the change; exit 75 "
        "naming those that have not.",
    ),
]
ByOpt = Annotated[str | None, typer.Option("--by", help="Who revokes, for the record [default: USER@HOST].")]


def revoke(
    kid: KidArg,
    reason: ReasonOpt,
    keystore_: KeystoreOpt = None,
    yes: YesOpt = False,
    keep_material: KeepOpt = False,
    force: ForceOpt = False,
    wait: WaitOpt = None,
    by: ByOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Revoke a key now, on every instance (no gates): its tokens are refused ('revoked kid'), a revoked
    primary is replaced at once, its material leaves the ring. Final. Prints the rounds it breaks first."""
    from mrtr_keys.audit.writing.stores.url import existing_store
    from mrtr_keys.backends import backend_for
    from mrtr_keys.changes.apply import apply_change
    from mrtr_keys.changes.lifecycle import parse_duration
    from mrtr_keys.changes.revoke import OP, check_reason
    from mrtr_keys.changes.revoke import revoke as revoke_key
    from mrtr_keys.cli.options import change_listeners, root_audit
    from mrtr_keys.cli.output import error, print_line
    from mrtr_keys.errors import AuditUnavailable, UnknownKid
    from mrtr_keys.fleet.compat_gate import refuse_unreadable
    from mrtr_keys.fleet.revoke_estimate import estimate
    from mrtr_keys.ring.compat import KEY_STATE_REVOKED
    from mrtr_keys.ring.model import utcnow

    reason = check_reason(reason)
    author = check_reason(by or _who(), "--by")
    seconds = None if wait is None else parse_duration(wait, "--wait")
    store = keystore(keystore_)
    ring = store.load()
    key = ring.lookup(kid)
    if key is None:
        raise UnknownKid(f"no key {kid} in key ring {ring.ring_id} (see: mrtr-keys keys list)")
    try:
        audit = existing_store(store, audit=root_audit())
    except AuditUnavailable as exc:
        raise _without_audit(exc, kid) from None
    result = None
    try:
        now = utcnow()
        # a revoked primary's successor may be the ring's first mk2 key: the same release (0.2.0) reads both
        note = None if key.revoked else refuse_unreadable(audit, ring, [KEY_STATE_REVOKED], now, force=force, what=OP)
        est = estimate(audit, ring, kid, now) if not key.revoked else None
        if est is not None and not yes:  # what it would break now, then ask
            if not json_:
                for line in est.lines(ring.ttl_seconds):
                    print_line(line)
            _confirm(kid, key.state.value, est, json_)

        def transform(r: Any, at: Any) -> Any:
            nonlocal est
            if est is not None:  # counted again just before the write (under the lock), printed before it
                est = estimate(audit, r, kid, at)
                if not json_:
                    for line in est.lines(r.ttl_seconds):
                        print_line(line)
            result = revoke_key(
                r,
                kid,
                at,
                reason=reason,
                by=author,
                backend=backend_for(r.codec),
                keep_material=keep_material,
                forced=note is not None,
            )
            return result

        result = apply_change(store, OP, transform, listeners=change_listeners())
        state: Applied | None = None
        if seconds is not None and result.changed:
            if audit is None:
                error("--wait: no audit store for this key ring, so no presence to wait on; not waited")
            else:
                state = _wait(audit, result.ring, seconds)
        _print(result, est, note, state, json_)
        if state is not None and not state.done:
            raise typer.Exit(75)
    except AuditUnavailable as exc:
        if result is not None:  # saved: only the wait could not read presence
            raise
        raise _without_audit(exc, kid) from None
    finally:
        if audit is not None:
            audit.close()


def _without_audit(exc: Exception, kid: str) -> Exception:
    """The audit store cannot be reached before the write (nothing written, exit 75): say so, and how to revoke
    without it in an emergency, which loses the estimate, the fleet check and the audit record (the ring still
    records who revoked the key, when and why)."""
    from mrtr_keys.errors import AuditUnavailable

    return AuditUnavailable(
        f"{exc}; nothing written (keys revoke reads the audit store for its estimate and fleet check, and records "
        f"the change there). To revoke without it, with no estimate, fleet check or audit record: "
        f"mrtr-keys --audit off keys revoke {kid} --reason TEXT --yes"
    )


def _who() -> str:
    """``USER@HOST`` of this run (the login name, else the uid)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry
        user = f"uid-{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def _confirm(kid: str, state: str, est: Any, json_: bool) -> None:
    """Ask on a terminal; without one (or with --json), exit 2 asking for --yes (the estimate is printed
    already, or goes into the JSON answer)."""
    from mrtr_keys.cli.output import error, print_json

    ask = f"revoking {kid} ({state}) is final; add --yes to revoke it"
    if json_ or not sys.stdin.isatty():
        if json_:
            print_json({"error": ask, "exit_code": 2, "estimate": est.to_json()})
        error(ask)
        raise typer.Exit(2)
    if not typer.confirm(f"Revoke {kid} ({state}) now, on every instance? This cannot be undone", default=False):
        error(f"{kid} not revoked")
        raise typer.Exit(1)


def _wait(audit: Any, ring: Any, seconds: float) -> Applied:
    """Wait for every live instance to report `ring`'s generation, one stderr line whenever that changes."""
    import time

    from mrtr_keys.cli.output import error
    from mrtr_keys.fleet.applied import wait_applied

    shown: list[str] = []

    def progress(state: Applied) -> None:
        text = state.describe(time.time())
        if not shown or shown[-1] != text:
            shown.append(text)
            error(f"waiting: {text}")

    return wait_applied(audit, ring, ring.generation, wait=seconds, on_wait=progress)


def _print(result: Any, est: Any, note: str | None, state: Applied | None, json_: bool) -> None:
    import time

    from mrtr_keys.cli.output import error, print_json, print_line

    now = time.time()
    if json_:
        doc: dict[str, Any] = {
            "step": result.op,
            "changed": result.changed,
            "forced": result.forced,
            "generation": result.ring.generation,
            "message": result.message,
            **result.details,
            "estimate": None if est is None else est.to_json(),
        }
        if note is not None:
            doc["forced_note"] = note
        if state is not None:
            doc["applied"] = {**state.to_json(now), "done": state.done}
        print_json(doc)
    else:
        print_line(result.message + (f" ({note})" if note else ""))
        if state is not None and state.done:
            print_line(state.describe(now))
    if state is not None and not state.done:
        error(
            f"the revocation is saved (generation {result.ring.generation}), but the wait ran out: "
            f"{state.describe(now)}. An instance with reload off, or cut from the keystore, cannot learn of it: "
            "restart it (or send the sidecar SIGHUP), or see docs/rotation.md"
        )
