"""Seal budgets in the ring (``mrtr-keys keys budget``) and the use condition of a scheduled ``rotate next``.

A key is spent by use (docs/token-format.md): each key has a seal budget (`mrtr_keys.ring.budgets`), and the
presence store keeps its fleet-wide seal count, never below the truth (`mrtr_keys.fleet.usage`).
`set_budget` changes the budget without a rotation: of one key, or of every key of the ring and the keys it
makes later (the ring's ``seal_budget``; a key's own budget is then cleared). `not_due` is what ``rotate next
--if-older-than AGE --if-used-over FRACTION`` asks before it begins a rotation: either condition triggers it; a
rotation already in progress always continues.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime, timedelta

from mrtr_keys.changes.apply import ChangeResult
from mrtr_keys.changes.lifecycle import _human, primary_age
from mrtr_keys.changes.rotation import Phase, status
from mrtr_keys.errors import ConfigError
from mrtr_keys.ring.budgets import budget_of, limit_of
from mrtr_keys.ring.model import MAX_BUDGET, KeyRing, KeyState, format_time


def parse_seals(text: str) -> int:
    """A number of seals from ``4000``, ``4_000``, ``4,000``, ``2^31`` or ``1e9`` (a whole number >= 1).

    Raises:
        ConfigError: anything else, in one line.
    """
    cleaned = text.strip().replace("_", "").replace(",", "")
    try:
        if "^" in cleaned:
            base, _, exp = cleaned.partition("^")
            b, e = int(base), int(exp)
            # past 2^63 the value is out of range anyway: never compute a power of millions of digits
            value: int = b**e if abs(b) < 2 or e <= 63 else MAX_BUDGET + 1
        else:
            number = float(cleaned) if any(c in cleaned for c in ".eE") else int(cleaned)
            value = int(number)
            if value != number:
                raise ValueError
    except (ValueError, OverflowError):
        raise ConfigError(f"SEALS must be a whole number of seals such as 4000 or 2^31 (got {text[:40]!r})") from None
    if not 1 <= value <= MAX_BUDGET:
        raise ConfigError(f"SEALS must be from 1 to {MAX_BUDGET:,} (got {text[:40]!r})")
    return value


def parse_fraction(text: str) -> float:
    """A fraction from ``0.5`` or ``50%``, above 0 and at most 1.

    Raises:
        ConfigError: anything else, in one line naming ``--if-used-over``.
    """
    cleaned = text.strip()
    try:
        value = float(cleaned[:-1]) / 100 if cleaned.endswith("%") else float(cleaned)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise ConfigError(f"--if-used-over must be a fraction above 0 and at most 1, such as 0.5 or 50% (got {text!r})")
    return value


def set_budget(ring: KeyRing, seals: int, kid: str | None, now: datetime) -> ChangeResult:
    """Set the seal budget of key `kid`, or (None) of every key of the ring and the keys it makes later.

    Raises:
        ConfigError: no such kid; `seals` above the documented limit of a key it applies to (a non-retired key's
            format, `mrtr_keys.ring.budgets.LIMITS`: a budget past it is not safe), or out of range.
    """
    if not 1 <= seals <= MAX_BUDGET:
        raise ConfigError(f"a seal budget is from 1 to {MAX_BUDGET:,} seals")
    one = ring.lookup(kid) if kid is not None else None
    if kid is not None:
        if one is None:
            raise ConfigError(f"no key {kid} in key ring {ring.ring_id} (see: mrtr-keys keys list)")
        targets = [one]
    else:
        targets = [k for k in ring.keys if k.state in (KeyState.PRIMARY, KeyState.VERIFY)]
    for key in targets:
        if seals > limit_of(key):
            raise ConfigError(
                f"{seals:,} seals is over the documented limit of key {key.kid}'s format {key.format.value} "
                f"({limit_of(key):,} seals a key at an attacker advantage of 2^-32; docs/token-format.md)"
            )
    if kid is not None:
        if one is not None and one.budget == seals:
            return _unchanged(ring, seals, kid)
        keys = tuple(replace(k, budget=seals) if k.kid == kid else k for k in ring.keys)
        after = ring.next_generation(keys=keys)
        message = f"seal budget of key {kid} set to {seals:,} seals (no rotation needed)"
    else:
        if ring.seal_budget == seals and all(k.budget is None for k in ring.keys):
            return _unchanged(ring, seals, None)
        keys = tuple(replace(k, budget=None) for k in ring.keys)
        after = ring.next_generation(keys=keys, seal_budget=seals)
        message = f"seal budget of every key, and of the keys made later, set to {seals:,} seals (no rotation needed)"
    return ChangeResult("budget", True, after, message, details={"kid": kid, "budget": seals})


def _unchanged(ring: KeyRing, seals: int, kid: str | None) -> ChangeResult:
    which = f"key {kid}" if kid else "every key"
    return ChangeResult(
        "budget", False, ring, f"the seal budget of {which} is already {seals:,} seals", details={"kid": kid}
    )


def not_due(
    ring: KeyRing,
    now: datetime,
    *,
    older_than: float | None = None,
    used_over: float | None = None,
    seals: int | None = None,
) -> ChangeResult | None:
    """For ``rotate next --if-older-than`` / ``--if-used-over``: a no-op result while no rotation is in progress
    and no given condition holds (the primary is younger than `older_than` seconds and has used no more than
    `used_over` of its seal budget, `seals` being its fleet-wide count); None when the rotation should go ahead:
    either condition holds, or a rotation is already in progress (it always continues).

    `seals` None means the count is unknown (no presence store): then `used_over` cannot trigger.
    """
    if (older_than is None and used_over is None) or status(ring, now).phase is not Phase.IDLE:
        return None
    primary = ring.primary
    age = primary_age(ring, now)
    budget = budget_of(ring, primary)
    if older_than is not None and age >= older_than:
        return None
    if used_over is not None and seals is not None and seals / budget > used_over:
        return None
    why: list[str] = []
    details: dict[str, object] = {"primary": primary.kid, "age_seconds": round(age, 3)}
    if older_than is not None:
        due = now + timedelta(seconds=older_than - age)
        why.append(f"is {_human(age)} old, younger than {_human(older_than)} (due by age after {format_time(due)})")
        details["due_at"] = format_time(due)
    if used_over is not None:
        details.update(seals=seals, budget=budget, used=None if seals is None else round(seals / budget, 6))
        if seals is None:
            why.append("has an unknown seal count (no presence store)")
        else:
            why.append(
                f"has used {seals:,} of its seal budget of {budget:,} ({_percent(seals / budget)}), "
                f"not over {_percent(used_over)}"
            )
    return ChangeResult(
        "next", False, ring, f"nothing to do: primary {primary.kid} " + " and ".join(why), details=details
    )


def _percent(fraction: float) -> str:
    """``51 %``, ``0.5 %``, ``<0.01 %`` (a budget's fraction in words; never an exponent)."""
    if 0 < fraction < 0.0001:
        return "<0.01 %"
    return f"{round(fraction * 100, 2):g} %"
