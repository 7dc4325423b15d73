"""What the CLI and the sidecar say of a ring's fleet-wide seal counts (`mrtr_keys.fleet.usage` keeps them):
the one sentence about a key's use of its budget, and the counts ``keys list``, ``keys show``, ``fleet status``
and ``rotate status`` print, or the one line saying why there are none."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mrtr_keys.audit.writing.stores.key_usage import KidTotals, totals
from mrtr_keys.errors import AuditError
from mrtr_keys.ring.budgets import WARN_AT, budget_of
from mrtr_keys.ring.model import KeyRing

if TYPE_CHECKING:
    from mrtr_keys.audit.writing.stores.base import AuditStore


def budget_note(kid: str, seals: int, budget: int) -> str:
    """The one sentence about a key's use of its budget: what the warning, ``fleet status`` and ``/readyz``
    say (e.g. ``key 1a2b3c4d has used 2,048 of its seal budget of 4,000 (51 %) fleet-wide; rotate it: mrtr-keys
    rotate next --if-used-over 0.5``). `seals` is the fleet-wide count, reservations included (never below the
    seals made)."""
    fraction = seals / budget
    head = f"key {kid} has used {seals:,} of its seal budget of {budget:,} ({math.floor(fraction * 100)} %) fleet-wide"
    if fraction >= 1.0:
        return f"{head}: past its budget, still sealing (its seals are audited 'over-budget'); rotate it now"
    return f"{head}; rotate it: mrtr-keys rotate next --if-used-over {WARN_AT:g}"


NO_STORE = (
    "seal counts: no presence store for this key ring (auditing off), so each instance counts its own seals "
    "(its /metrics or OpenTelemetry); there is no fleet-wide total"
)
"""The one line the CLI prints instead of fleet-wide counts when there is no presence store."""


@dataclass(frozen=True)
class UsageView:
    """A ring's fleet-wide counts as the CLI shows them: `totals` from the presence store, or None with `note`."""

    totals: dict[str, KidTotals] | None
    note: str | None = None

    def of(self, ring: KeyRing, kid: str) -> dict[str, Any]:
        """``seals``, ``unseals``, ``rejections`` (fleet-wide, None when unknown), ``budget`` and ``used`` (the
        fraction of the budget sealed, None when unknown) of key `kid` of `ring`."""
        key = ring.lookup(kid)
        budget = budget_of(ring, key) if key is not None else None
        t = None if self.totals is None else self.totals.get(kid)
        known = self.totals is not None
        seals = t.seals if t is not None else (0 if known else None)
        return {
            "seals": seals,
            "unseals": t.unseals if t is not None else (0 if known else None),
            "rejections": t.rejections if t is not None else (0 if known else None),
            "budget": budget,
            "used": None if seals is None or not budget else round(seals / budget, 6),
        }


def read_usage(store: AuditStore | None, ring: KeyRing) -> UsageView:
    """The fleet-wide counts of `ring` in `store` (the presence store; None: there is none, `NO_STORE`).
    A store that cannot be read gives a note saying so, never an error (the keys are still shown)."""
    if store is None:
        return UsageView(None, NO_STORE)
    try:
        return UsageView(totals(store.usage_rows(ring.ring_id)))
    except AuditError as exc:
        return UsageView(None, f"seal counts unavailable: {exc}")
