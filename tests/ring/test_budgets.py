"""Seal budgets in the ring (issue 36): each format's documented per-key limit halved by default, a ring-wide
budget for every key without its own (``keys budget SEALS``), a key's own above both; recorded in the ring
document so every instance and the CLI agree, and ignored by older readers."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mrtr_keys.errors import KeyRingError
from mrtr_keys.ring.budgets import LIMITS, block_of, budget_of, default_budget
from mrtr_keys.ring.document import parse_ring
from mrtr_keys.ring.model import MAX_BUDGET, KeyFormat
from tests.fixtures.keyrings import fresh_ring


def test_default_budgets_are_half_the_documented_limits() -> None:
    """NIST SP 800-38D 8.3 (2^32, mk1 and the SDK's v1.) and RFC 8452 section 9 (2^48, mk2), 2x margin."""
    assert LIMITS == {KeyFormat.MK1: 2**32, KeyFormat.SDK_V1: 2**32, KeyFormat.MK2: 2**48}
    ring = fresh_ring()
    assert default_budget(ring.primary) == 2**47 == budget_of(ring, ring.primary)
    assert default_budget(replace(ring.primary, format=KeyFormat.MK1)) == 2**31


def test_a_keys_own_budget_wins_over_the_rings_which_wins_over_the_default() -> None:
    ring = fresh_ring()
    key = ring.primary
    with_ring_budget = replace(ring, seal_budget=4000)
    assert budget_of(with_ring_budget, key) == 4000
    assert budget_of(with_ring_budget, replace(key, budget=10)) == 10
    assert block_of(4000) == 40 and block_of(50) == 1 and block_of(2**47) == 2**47 // 100


def test_no_budget_is_above_the_limit_of_its_keys_format() -> None:
    """A ring-wide budget meant for mk2 keys (2^40, allowed: under mk2's 2^48) must not carry an mk1 key made
    later (``rotate begin --key-format mk1``) past mk1's 2^32, where its advantage bound no longer holds; nor may a
    hand-edited key budget. The budget is then the format's limit."""
    ring = replace(fresh_ring(), seal_budget=2**40)
    mk1 = replace(ring.primary, format=KeyFormat.MK1)
    assert budget_of(ring, ring.primary) == 2**40
    assert budget_of(ring, mk1) == LIMITS[KeyFormat.MK1] == 2**32
    assert budget_of(ring, replace(mk1, budget=2**50)) == 2**32


def test_budgets_round_trip_and_are_written_only_when_set() -> None:
    ring = fresh_ring()
    assert "seal_budget" not in json.loads(ring.dumps()) and "budget" not in json.loads(ring.dumps())["keys"][0]
    set_ = replace(ring, seal_budget=4000, keys=(replace(ring.primary, budget=123),))
    doc = json.loads(set_.dumps())
    assert doc["seal_budget"] == 4000 and doc["keys"][0]["budget"] == 123
    assert parse_ring(set_.dumps()) == set_
    assert set_.describe()["seal_budget"] == 4000 and set_.describe()["keys"][0]["budget"] == 123


@pytest.mark.parametrize("bad", [0, -1, 1.5, "10", True, MAX_BUDGET + 1])
def test_a_bad_budget_is_refused_in_one_line(bad: object) -> None:
    doc = json.loads(fresh_ring().dumps())
    for where in ("ring", "key"):
        edited = json.loads(json.dumps(doc))
        (edited if where == "ring" else edited["keys"][0])["seal_budget" if where == "ring" else "budget"] = bad
        with pytest.raises(KeyRingError, match="budget must be a whole number of seals") as info:
            parse_ring(json.dumps(edited))
        assert "\n" not in str(info.value)
