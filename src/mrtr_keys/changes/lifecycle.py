"""Key ring changes outside the three rotation phases: destroy a retired key, abort a begun
rotation, change the TTL, and the age condition of a scheduled ``rotate next``.

Each is a pure transition on a `KeyRing` with an injected time, returning a `ChangeResult`
that `mrtr_keys.changes.apply.apply_change` saves as the next generation (re-running a change
just made is a no-op success, as for the rotation steps).

TTL changes are safe by construction. The ring's ``ttl_seconds`` bounds every MCP server's
``RequestStateSecurity(ttl=...)`` (checked when the server starts) and the retire gate
(promote + TTL + 60 s). Raising it takes effect at once: gates only wait longer. Lowering it
is two steps: the first records the request (``ttl_lowering``); from then on a server starting
with a longer ``ttl`` is refused, while the gates keep the old TTL. The second (the same command,
run later) puts the lower TTL in force once the old TTL + 60 s have passed since the last seal
that may have carried the old TTL: since the request, and, when an audit log is kept, since the
last seal by an instance that was already running before the request (`last_old_seal`).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from datetime import datetime, timedelta

from mrtr_keys.changes.apply import ChangeResult
from mrtr_keys.changes.rotation import FUTURE_SKEW_SECONDS, Phase, status
from mrtr_keys.errors import ConfigError, NotYet, RotationError
from mrtr_keys.ring.model import KeyRing, KeyState, TtlLowering, check_ttl, format_time

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds from ``30d``, ``12h``, ``90m``, ``45s``, ``2w`` or a plain number of seconds.

    Raises:
        ConfigError: anything else, in one line naming `what`.
    """
    m = _DURATION.match(text)
    if m is None:
        raise ConfigError(f"{what} must be a duration such as 30d, 12h, 90m or 3600 (got {text!r})")
    return float(m.group(1)) * _UNIT_SECONDS[m.group(2)]


def primary_age(ring: KeyRing, now: datetime) -> float:
    """Seconds since the primary key started sealing (its promote time, else its creation)."""
    since = ring.primary.promoted_at or ring.primary.created_at
    return (now - since).total_seconds()


def younger_than(ring: KeyRing, now: datetime, seconds: float) -> ChangeResult | None:
    """For ``rotate next --if-older-than``: a no-op result while no rotation is in progress and
    the primary is younger than `seconds`; None when the rotation should go ahead (a rotation
    already in progress always continues)."""
    if status(ring, now).phase is not Phase.IDLE:
        return None
    age = primary_age(ring, now)
    if age >= seconds:
        return None
    due = now + timedelta(seconds=seconds - age)
    return ChangeResult(
        "next",
        False,
        ring,
        f"nothing to do: primary {ring.primary.kid} is {_human(age)} old, younger than {_human(seconds)}; "
        f"the next rotation is due after {format_time(due)}",
        details={"primary": ring.primary.kid, "age_seconds": round(age, 3), "due_at": format_time(due)},
    )


def destroy(ring: KeyRing, kid: str, now: datetime) -> ChangeResult:
    """Remove a retired (or revoked, ``--keep-material``) key's material (and wrapped key / backend data);
    keep its record.

    Raises:
        ConfigError: no such kid.
        RotationError: the key is not retired or revoked (verify and primary keys still unseal).
    """
    key = ring.lookup(kid)
    if key is None:
        raise ConfigError(f"no key {kid} in this key ring (see: mrtr-keys keys list)")
    if key.destroyed:
        return ChangeResult(
            "destroy", False, ring, f"key {kid} was already destroyed at {format_time(key.destroyed_at)}", details={}
        )
    if not (key.state is KeyState.RETIRED or key.state is KeyState.REVOKED):
        hint = {
            KeyState.PRIMARY: "rotate first (mrtr-keys rotate next)",
            KeyState.VERIFY: "it still opens tokens in flight; finish the rotation first (mrtr-keys rotate retire)",
        }[key.state]
        raise RotationError(f"only a retired key can be destroyed; {kid} is {key.state.value}: {hint}")
    keys = tuple(replace(k, material=None, key_data={}, destroyed_at=now) if k.kid == kid else k for k in ring.keys)
    return ChangeResult(
        "destroy",
        True,
        ring.next_generation(keys=keys),
        f"key {kid} destroyed: its material is gone from the ring; the record (kid, state, times) is kept",
        details={"kid": kid},
    )


def abort(ring: KeyRing, now: datetime) -> ChangeResult:
    """Undo a `begin` before the promote: remove the new verify key.

    Raises:
        RotationError: the rotation was promoted (the new key may have sealed tokens already).
    """
    st = status(ring, now)
    if st.phase is Phase.IDLE:
        return ChangeResult("abort", False, ring, "no rotation in progress; nothing to abort", details={})
    if st.phase is Phase.PROMOTED:
        assert st.old is not None
        raise RotationError(
            f"cannot abort after promote: {st.primary.kid} already seals tokens that only it opens; "
            "finish with: mrtr-keys rotate retire"
        )
    assert st.new is not None
    new = st.new
    keys = tuple(k for k in ring.keys if k.kid != new.kid)
    return ChangeResult(
        "abort",
        True,
        ring.next_generation(keys=keys),
        f"rotation aborted: {new.kid} removed; {st.primary.kid} still seals. Start again with: mrtr-keys rotate begin",
        details={"removed": new.kid, "primary": st.primary.kid},
    )


def set_ttl(ring: KeyRing, seconds: float, now: datetime, *, last_old_seal: datetime | None = None) -> ChangeResult:
    """Change the ring's TTL without a rotation (see the module docstring for why it is safe).

    `last_old_seal`: the last seal the audit log shows from an instance running before the
    lowering was requested (None without an audit log or when there is none).

    Raises:
        ConfigError: `seconds` is not a usable TTL.
        NotYet: a lowering was requested but old tokens may still be in flight; `wait_seconds` says
            how long (exit 75).
    """
    new = check_ttl(seconds)
    old = ring.ttl_seconds
    pending = ring.ttl_lowering
    if new >= old:
        if new == old and pending is None:
            return ChangeResult("ttl", False, ring, f"TTL is already {_s(old)}", details=ttl_info(ring))
        after = ring.next_generation(ttl_seconds=new, ttl_lowering=None)
        what = "kept at" if new == old else "raised to"
        msg = f"TTL {what} {_s(new)}, in force now" + (" (the pending lowering is cancelled)" if pending else "")
        return ChangeResult("ttl", True, after, msg, details=ttl_info(after))
    if pending is None or pending.ttl_seconds != new:
        after = ring.next_generation(ttl_lowering=TtlLowering(new, now))
        ready = now + timedelta(seconds=old + FUTURE_SKEW_SECONDS)
        return ChangeResult(
            "ttl",
            True,
            after,
            f"TTL lowering to {_s(new)} requested; servers starting now must use ttl <= {_s(new)}; "
            f"the rotation gates keep {_s(old)} until tokens sealed under it have expired. Restart running "
            f"servers with the lower ttl, then run this again after {format_time(ready)}",
            details=ttl_info(after, ready_at=ready),
        )
    since = max(pending.requested_at, last_old_seal or pending.requested_at)
    ready = since + timedelta(seconds=old + FUTURE_SKEW_SECONDS)
    if now < ready:
        wait = (ready - now).total_seconds()
        cause = "the last seal by an instance started before the request" if since > pending.requested_at else ""
        raise NotYet(
            f"lowering the TTL to {_s(new)} now could expire the retire gate under tokens sealed with {_s(old)}: "
            f"waiting {math.ceil(wait)} s more, until {format_time(ready)} "
            f"({cause or 'the request'} + {_s(old)} + {FUTURE_SKEW_SECONDS:g} s)",
            wait_seconds=wait,
        )
    after = ring.next_generation(ttl_seconds=new, ttl_lowering=None)
    return ChangeResult("ttl", True, after, f"TTL lowered to {_s(new)}, in force now", details=ttl_info(after))


def ttl_info(ring: KeyRing, *, ready_at: datetime | None = None) -> dict[str, object]:
    """The TTL in force (seconds), a pending lower one and when it was requested."""
    low = ring.ttl_lowering
    out: dict[str, object] = {
        "ttl_seconds": ring.ttl_seconds,
        "pending_ttl_seconds": low.ttl_seconds if low else None,
        "requested_at": format_time(low.requested_at) if low else None,
    }
    if ready_at is not None:
        out["ready_at"] = format_time(ready_at)
    return out


def _s(seconds: float) -> str:
    return f"{seconds:g} s"


def _human(seconds: float) -> str:
    """3d 4h, 5h 12m, 12m 30s, 40s."""
    s = max(0, int(seconds))
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    m, sec = divmod(rem, 60)
    if d:
        return f"{d}d {h}h" if h else f"{d}d"
    if h:
        return f"{h}h {m}m" if m else f"{h}h"
    if m:
        return f"{m}m {sec}s" if sec else f"{m}m"
    return f"{sec}s"
