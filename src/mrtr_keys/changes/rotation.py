"""Three-phase zero-downtime key rotation, as the MCP SDK docs define it.

    phase 1 `begin`:   NEW added as ``verify``; every instance learns to verify NEW, OLD still seals
    phase 2 `promote`: NEW becomes ``primary``, OLD ``verify``; in-flight OLD tokens keep verifying
    phase 3 `retire`:  OLD ``retired``, allowed once TTL + 60 s (the SDK's future-skew allowance)
                       have passed since the promote

Each step is a pure transition on a `KeyRing` with an injected time; re-running
the step just done is a no-op success, and a step that skips ahead or goes back
raises `RotationError` naming the command to run instead. `NotYet` (exit 75)
means "allowed later" and carries the wait in seconds. `run_step` applies a
step to a keystore through `mrtr_keys.changes.apply.apply_change`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from mrtr_keys.backends import Backend, backend_for, key_format_for
from mrtr_keys.changes.apply import ChangeCheck, ChangeListener, ChangeResult, apply_change
from mrtr_keys.errors import ConfigError, NotYet, RotationError
from mrtr_keys.keystores import Keystore
from mrtr_keys.ring.model import Key, KeyFormat, KeyRing, KeyState, check_ttl, format_time, new_kid

FUTURE_SKEW_SECONDS = 60.0
"""The MCP SDK accepts tokens minted up to 60 s in the future (`_FUTURE_SKEW` in request_state.py)."""

STEPS = ("begin", "promote", "retire")


class Phase(StrEnum):
    """Where a ring is in its rotation."""

    IDLE = "idle"
    BEGUN = "begun"
    PROMOTED = "promoted"


@dataclass(frozen=True)
class RotationStatus:
    """A ring's rotation state at a given time (all times UTC, waits in seconds)."""

    phase: Phase
    primary: Key
    new: Key | None
    old: Key | None
    next_step: str
    retire_at: datetime | None
    wait_seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "phase_number": {Phase.IDLE: 0, Phase.BEGUN: 1, Phase.PROMOTED: 2}[self.phase],
            "primary": self.primary.kid,
            "new": self.new.kid if self.new else None,
            "old": self.old.kid if self.old else None,
            "next_step": self.next_step,
            "retire_at": format_time(self.retire_at),
            "wait_seconds": round(self.wait_seconds, 3),
        }


def status(ring: KeyRing, now: datetime) -> RotationStatus:
    """Classify `ring`. Raises `RotationError` for a ring no sequence of steps could produce."""
    verify = [k for k in ring.keys if k.state is KeyState.VERIFY]
    primary = ring.primary
    if not verify:
        return RotationStatus(Phase.IDLE, primary, None, None, "begin", None, 0.0)
    if len(verify) > 1 and all(k.demoted_at is not None for k in verify):
        # Several old keys at once: a ring adopted from the MCP SDK's keys=[k0, k1, ...] starts
        # with k1... demoted (ring.create.create_ring_from_sdk_keys); `retire` retires them all.
        verify = verify[:1]
    elif len(verify) > 1:
        kids = ", ".join(k.kid for k in verify)
        raise RotationError(f"key ring has {len(verify)} verify keys ({kids}); expected at most one mid-rotation")
    (other,) = verify
    if other.demoted_at is None:
        return RotationStatus(Phase.BEGUN, primary, other, primary, "promote", None, 0.0)
    retire_at = retire_ready_at(ring)
    wait = max(0.0, (retire_at - now).total_seconds())
    return RotationStatus(Phase.PROMOTED, primary, primary, other, "retire", retire_at, wait)


def retire_ready_at(ring: KeyRing) -> datetime:
    """When OLD may be retired: the promote time + the ring's TTL + `FUTURE_SKEW_SECONDS`."""
    promoted = ring.primary.promoted_at or ring.primary.created_at
    return promoted + timedelta(seconds=ring.ttl_seconds + FUTURE_SKEW_SECONDS)


def begin(
    ring: KeyRing,
    now: datetime,
    backend: Backend,
    *,
    ttl: float | None = None,
    key_format: KeyFormat | str | None = None,
) -> ChangeResult:
    """Phase 1: add NEW as ``verify``; OLD keeps sealing. `ttl` (seconds) updates the stored TTL; NEW has
    `key_format`, by default the newest format the ring's codec seals (``mk2``; `key_format_for`)."""
    st = status(ring, now)
    if st.phase is Phase.BEGUN:
        assert st.new is not None
        if ttl is not None and check_ttl(ttl) != ring.ttl_seconds:
            raise RotationError(
                f"rotation already begun with TTL {ring.ttl_seconds:g} s; --ttl {ttl:g} was not applied. "
                "A TTL is set when a rotation begins: finish this one (mrtr-keys rotate promote, then retire) "
                "and pass --ttl to the next begin"
            )
        return ChangeResult(
            "begin",
            False,
            ring,
            f"rotation already begun: {st.new.kid} verifies, {st.primary.kid} still seals; "
            "next: mrtr-keys rotate promote",
            details={"new": st.new.kid, "old": st.primary.kid},
        )
    if st.phase is Phase.PROMOTED:
        assert st.old is not None
        raise RotationError(
            f"the previous rotation is not finished: {st.old.kid} is not yet retired; "
            "run: mrtr-keys rotate retire (or: mrtr-keys rotate next)"
        )
    changes: dict[str, Any] = {}
    if ttl is not None:
        changes["ttl_seconds"] = check_ttl(ttl)
        changes["ttl_lowering"] = None  # an explicit TTL at begin replaces a pending lowering
    fmt = key_format_for(backend, key_format)
    kid = new_kid(k.kid for k in ring.keys)
    key = backend.new_key(ring_id=ring.ring_id, kid=kid, state=KeyState.VERIFY, audiences=ring.audiences, now=now)
    after = ring.next_generation(keys=(*ring.keys, replace(key, format=fmt)), **changes)
    return ChangeResult(
        "begin",
        True,
        after,
        f"phase 1: {kid} ({fmt.value}) added as verify; {ring.primary.kid} still seals. "
        "Roll this out to every instance, then run: mrtr-keys rotate promote",
        details={"new": kid, "old": ring.primary.kid, "format": fmt.value},
    )


def promote(ring: KeyRing, now: datetime) -> ChangeResult:
    """Phase 2: NEW becomes ``primary``, OLD ``verify``."""
    st = status(ring, now)
    if st.phase is Phase.PROMOTED:
        assert st.old is not None
        return ChangeResult(
            "promote",
            False,
            ring,
            f"already promoted: {st.primary.kid} seals, {st.old.kid} verifies; next: mrtr-keys rotate retire",
            details={"new": st.primary.kid, "old": st.old.kid},
        )
    if st.phase is Phase.IDLE:
        replaced = _revoked_for(ring, ring.primary.promoted_at)
        if replaced is not None:  # a revocation of the sealing key promoted the begun one: the promote's end holds
            return ChangeResult(
                "promote",
                False,
                ring,
                f"already promoted: {ring.primary.kid} seals since {replaced.kid} was revoked; "
                "the rotation is complete",
                details={"new": ring.primary.kid, "old": replaced.kid},
            )
        raise RotationError("no rotation has begun, so there is nothing to promote; run: mrtr-keys rotate begin")
    assert st.new is not None
    old, new = st.primary, st.new
    keys = tuple(
        replace(k, state=KeyState.PRIMARY, promoted_at=now)
        if k.kid == new.kid
        else replace(k, state=KeyState.VERIFY, demoted_at=now)
        if k.kid == old.kid
        else k
        for k in ring.keys
    )
    after = ring.next_generation(keys=keys)
    ready = retire_ready_at(after)
    return ChangeResult(
        "promote",
        True,
        after,
        f"phase 2: {new.kid} now seals; {old.kid} still verifies. "
        f"Retire it after {format_time(ready)} (TTL {ring.ttl_seconds:g} s + {FUTURE_SKEW_SECONDS:g} s): "
        "mrtr-keys rotate retire",
        details={"new": new.kid, "old": old.kid, "retire_at": format_time(ready)},
    )


def retire(ring: KeyRing, now: datetime, *, force: bool = False) -> ChangeResult:
    """Phase 3: OLD becomes ``retired``, once TTL + 60 s have passed since the promote (or `force`).

    Raises:
        NotYet: too early and not forced; `wait_seconds` says how long.
        RotationError: nothing to retire (rotation not begun, or not promoted).
    """
    st = status(ring, now)
    if st.phase is Phase.IDLE:
        last = _last_retired(ring)
        if (
            last is not None
            and ring.primary.promoted_at is not None
            and last.retired_at is not None
            and (last.retired_at >= ring.primary.promoted_at)
        ):
            return ChangeResult(
                "retire",
                False,
                ring,
                f"already retired: {last.kid}; {ring.primary.kid} is the only key in use",
                details={"old": last.kid, "new": ring.primary.kid},
            )
        revoked = _revoked_for(ring, ring.primary.promoted_at, since=True)
        if revoked is not None:  # the old key was revoked since the promote: the retire's end holds
            return ChangeResult(
                "retire",
                False,
                ring,
                f"already out of use: {revoked.kid} was revoked; {ring.primary.kid} is the only key in use",
                details={"old": revoked.kid, "new": ring.primary.kid},
            )
        raise RotationError("no rotation is in progress, so there is nothing to retire; run: mrtr-keys rotate begin")
    if st.phase is Phase.BEGUN:
        revoked = _revoked_for(ring, ring.primary.promoted_at, since=True)
        if revoked is not None and revoked.demoted_at is not None and st.new is not None:
            # A retire waiting on the last rotation's old key: a revocation took that key out of use, and another
            # rotation began before the waiter looked again. Its end holds; the new rotation goes on by itself.
            return ChangeResult(
                "retire",
                False,
                ring,
                f"already out of use: {revoked.kid} was revoked; a rotation has begun since ({st.new.kid} "
                "verifies); next: mrtr-keys rotate promote",
                details={"old": revoked.kid, "new": ring.primary.kid},
            )
        raise RotationError(
            "the new key is not sealing yet, so the old one cannot be retired; run: mrtr-keys rotate promote"
        )
    assert st.old is not None and st.retire_at is not None
    if st.wait_seconds > 0 and not force:
        gate = f"promote + TTL {ring.ttl_seconds:g} s + {FUTURE_SKEW_SECONDS:g} s, until {format_time(st.retire_at)}"
        raise NotYet(
            f"retiring {st.old.kid} now would reject tokens still in flight: waiting {math.ceil(st.wait_seconds)} s "
            f"more, until {format_time(st.retire_at)} "
            f"(promote + TTL {ring.ttl_seconds:g} s + {FUTURE_SKEW_SECONDS:g} s)",
            wait_seconds=st.wait_seconds,
            waits=[{"for": "TTL", "seconds": round(st.wait_seconds, 3), "detail": gate}],
        )
    olds = [k.kid for k in ring.keys if k.state is KeyState.VERIFY and k.demoted_at is not None]
    keys = tuple(replace(k, state=KeyState.RETIRED, retired_at=now) if k.kid in olds else k for k in ring.keys)
    after = ring.next_generation(keys=keys)
    early = st.wait_seconds > 0
    msg = f"phase 3: {', '.join(olds)} retired; {ring.primary.kid} is the only key in use"
    if early:
        msg += (
            f" (forced {math.ceil(st.wait_seconds)} s before the TTL gate: tokens sealed with {st.old.kid} "
            "in the last TTL are now rejected)"
        )
    return ChangeResult("retire", True, after, msg, forced=early, details={"old": st.old.kid, "new": ring.primary.kid})


def _revoked_for(ring: KeyRing, at: datetime | None, *, since: bool = False) -> Key | None:
    """The newest key revoked at `at` (the change that promoted the primary), or, with `since`, at or after
    it; None if there is none. A rotation step a revocation has already made (`promote`, `retire`) is then
    reported done, so a pipeline waiting on it (``rotate next --wait``) ends as after the step itself."""
    if at is None:
        return None
    revoked = [
        k
        for k in ring.keys
        if k.state is KeyState.REVOKED
        and k.revoked_at is not None
        and (k.revoked_at >= at if since else k.revoked_at == at)
    ]
    return max(revoked, key=lambda k: k.revoked_at or k.created_at, default=None)


def _last_retired(ring: KeyRing) -> Key | None:
    retired = [k for k in ring.keys if k.state is KeyState.RETIRED and k.retired_at is not None]
    return max(retired, key=lambda k: k.retired_at or k.created_at, default=None)


def transition(
    step: str,
    ring: KeyRing,
    now: datetime,
    *,
    force: bool = False,
    ttl: float | None = None,
    key_format: KeyFormat | str | None = None,
) -> ChangeResult:
    """Run `step` (``begin``, ``promote``, ``retire`` or ``next``) on `ring` at `now`; pure but for
    `begin`, which asks the ring's backend for a new key (of `key_format`, see `begin`)."""
    if step == "next":
        step = status(ring, now).next_step
    if step == "begin":
        return begin(ring, now, backend_for(ring.codec), ttl=ttl, key_format=key_format)
    if step == "promote":
        return promote(ring, now)
    if step == "retire":
        return retire(ring, now, force=force)
    raise ConfigError(f"unknown rotation step {step!r} (begin, promote, retire, next)")


def run_step(
    keystore: Keystore,
    step: str,
    *,
    now: datetime | None = None,
    force: bool = False,
    ttl: float | None = None,
    gate: Callable[[str, KeyRing, datetime], str | None] | None = None,
    listeners: Sequence[ChangeListener] = (),
    check: ChangeCheck | None = None,
    key_format: KeyFormat | str | None = None,
) -> ChangeResult:
    """Apply a rotation step to the stored ring (see `transition`, `apply_change`).

    `listeners` are called with the saved change (pass the audit log's
    `mrtr_keys.audit.ring_changes.change_listener()` to record it as the CLI does).

    `gate(step, ring, now)`, if given, runs first with ``next`` resolved to the step it means
    (the audit log's gates, `mrtr_keys.fleet.gates`); it raises `NotYet` to refuse, or returns a
    note when it let the step pass only because of an override (a narrowed window). `force`
    overrides a refusal. Either way the result is then marked forced. `check` is `apply_change`'s (e.g.
    `mrtr_keys.fleet.compat_gate.readers_check_for`: no ``begin`` of an ``mk2`` key while a live instance
    cannot read it); `key_format` is `begin`'s.
    """

    def transform(ring: KeyRing, at: datetime) -> ChangeResult:
        overridden: str | None = None
        if gate is not None:
            try:
                overridden = gate(status(ring, at).next_step if step == "next" else step, ring, at)
            except NotYet as exc:
                if not force:
                    raise
                overridden = str(exc)
        result = transition(step, ring, at, force=force, ttl=ttl, key_format=key_format)
        if overridden is not None and result.changed:
            result = replace(result, forced=True, message=f"{result.message} (forced past a gate: {overridden})")
        return result

    return apply_change(keystore, step, transform, now=now, listeners=listeners, check=check)
