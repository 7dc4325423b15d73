"""Seal budgets: how many tokens a key may seal before it is due for rotation, by token format.

A key's budget is its own ``budget``, else the ring's ``seal_budget`` (``mrtr-keys keys budget SEALS``),
else its format's default: the format's documented per-key limit (`LIMITS`) halved, a margin of 2x, so a
key that reaches 100 % of its budget is still inside the limit (reaching it never stops sealing: an outage
is worse). The limits, with their sources (docs/token-format.md):

* ``mk1`` and ``sdk-v1`` (AES-256-GCM, a random 96-bit nonce per token): 2^32 seals, NIST SP 800-38D
  section 8.3 (random IVs); draft-irtf-cfrg-aead-limits gives the same order for an attacker advantage of
  2^-32. A ring of the ``vault-transit`` codec in remote mode seals through Vault (aes256-gcm96, random
  nonces): the same 2^32 per transit key version, which Vault's transit docs repeat.
* ``mk2`` (AES-256-GCM-SIV, a random 96-bit nonce): 2^48 seals of plaintexts up to 32 MiB (every token
  here: payloads stop at 3 MiB) at an attacker advantage of at most 2^-32, RFC 8452 section 9 (from
  Gueron, Langley and Lindell, "AES-GCM-SIV: Specification and Analysis", 2017).

Each limit is per derived (kid, audience) key; counts are kept per kid over every audience, which errs on
the safe side. A reservation block (`block_of`) is at most 1 % of a budget, so what an instance reserves
ahead can never by itself push a key past a threshold.
"""

from __future__ import annotations

from mrtr_keys.ring.model import Key, KeyFormat, KeyRing

LIMITS: dict[KeyFormat, int] = {KeyFormat.MK1: 2**32, KeyFormat.SDK_V1: 2**32, KeyFormat.MK2: 2**48}
"""Documented seals per key at which a format stays within an attacker advantage of 2^-32 (module docstring)."""
MARGIN = 2
"""A default budget is the limit divided by this."""
WARN_AT = 0.5
"""Fraction of a budget at which an instance warns once, ``fleet status`` and ``/readyz`` say so, and the
alert ``MrtrKeysSealBudgetHalfUsed`` fires (deploy/prometheus/alerts.yaml)."""
BLOCK_FRACTION = 100
"""A reservation block is at most 1/100 of a key's budget (`block_of`)."""


def limit_of(key: Key) -> int:
    """The documented per-key limit of `key`'s format, in seals."""
    return LIMITS[key.format]


def default_budget(key: Key) -> int:
    """`limit_of` `key` divided by `MARGIN`."""
    return limit_of(key) // MARGIN


def budget_of(ring: KeyRing, key: Key) -> int:
    """`key`'s seal budget: its own, else the ring's ``seal_budget``, else its format's default; never above its
    format's limit (`limit_of`). ``keys budget`` refuses more for the keys a ring holds, but the ring's budget
    also applies to keys made later, whose format may differ (an ``mk2`` ring's 2^40 and a ``rotate begin
    --key-format mk1``), and a ring file may be edited by hand."""
    if key.budget is not None:
        budget = key.budget
    elif ring.seal_budget is not None:
        budget = ring.seal_budget
    else:
        return default_budget(key)
    return min(budget, limit_of(key))


def block_of(budget: int) -> int:
    """The largest reservation block for a key with this budget: 1 % of it, at least 1 seal."""
    return max(1, budget // BLOCK_FRACTION)


def used(seals: int | None, budget: int) -> float | None:
    """The fraction of `budget` that `seals` has used (may exceed 1.0); None when the count is unknown."""
    return None if seals is None else seals / budget
