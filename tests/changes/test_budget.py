"""Seal budgets without a rotation and the use condition of a scheduled ``rotate next`` (issue 36,
`mrtr_keys.changes.budget`): a budget above a key's format limit is refused, the ring's budget covers the keys it
makes later, and ``--if-used-over`` with ``--if-older-than`` begins a rotation when either holds, never gating a
rotation already in progress."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from mrtr_keys.changes.apply import apply_change
from mrtr_keys.changes.budget import not_due, parse_fraction, parse_seals, set_budget
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step, transition
from mrtr_keys.errors import ConfigError
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.budgets import budget_of
from mrtr_keys.ring.model import KeyFormat
from tests.fixtures.common import run_cli
from tests.fixtures.keyrings import T0, fresh_ring


def test_the_rings_budget_covers_every_key_and_the_keys_it_makes_later(tmp_path: Path) -> None:
    store = FileKeystore(tmp_path / "keyring.json")
    create_ring(store)
    done = apply_change(store, "budget", lambda ring, now: set_budget(ring, 4000, None, now))
    assert done.changed and done.ring.seal_budget == 4000 and "no rotation needed" in done.message
    again = apply_change(store, "budget", lambda ring, now: set_budget(ring, 4000, None, now))
    assert not again.changed  # re-run: nothing written
    begun = run_step(store, "begin").ring
    assert [budget_of(begun, k) for k in begun.keys] == [4000, 4000]
    new = begun.keys[-1].kid
    one = apply_change(store, "budget", lambda ring, now: set_budget(ring, 10, new, now)).ring
    assert [budget_of(one, k) for k in one.keys] == [4000, 10]
    every = apply_change(store, "budget", lambda ring, now: set_budget(ring, 500, None, now)).ring
    assert [budget_of(every, k) for k in every.keys] == [500, 500]  # "every key" clears a key's own


def test_a_budget_above_a_keys_format_limit_or_for_no_such_key_is_refused() -> None:
    mk1 = fresh_ring(key_format=KeyFormat.MK1)
    with pytest.raises(ConfigError, match=r"over the documented limit of key \w+'s format mk1 \(4,294,967,296"):
        set_budget(mk1, 2**32 + 1, None, T0)
    assert set_budget(fresh_ring(), 2**48, None, T0).changed  # mk2: 2^48
    with pytest.raises(ConfigError, match="no key 00000000"):
        set_budget(mk1, 10, "00000000", T0)


@pytest.mark.parametrize(
    ("text", "value"), [("4000", 4000), ("4,000", 4000), ("4_000", 4000), ("2^31", 2**31), ("1e9", 10**9)]
)
def test_seals_are_read_as_people_write_them(text: str, value: int) -> None:
    assert parse_seals(text) == value


@pytest.mark.parametrize("text", ["0", "-5", "1.5", "ten", "2^99", ""])
def test_bad_seals_are_one_line(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_seals(text)
    assert "\n" not in str(info.value)


@pytest.mark.timeout(20)
def test_a_huge_power_is_refused_without_computing_it() -> None:
    """``keys budget 3^100000000`` ran for minutes on one core (Python computed the power before the range
    check); it is out of range at once, in one line like the others."""
    with pytest.raises(ConfigError, match=r"SEALS must be from 1 to 9,007,199,254,740,991 \(got '3\^100000000'\)"):
        parse_seals("3^100000000")
    assert parse_seals("1^100000000") == 1


def test_a_budget_above_the_format_limit_of_a_key_made_later_counts_as_that_limit(tmp_path: Path) -> None:
    """The ring's budget covers the keys it makes later (above), whatever their format: 2^40 is a fine budget
    for mk2 keys (limit 2^48), but an mk1 key begun under it (``--key-format mk1``) is held to mk1's 2^32."""
    from tests.fixtures.audit import cli  # in this process: no interpreter start-ups

    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    assert cli("keys", "budget", "2^40", keystore=ring).code == 0
    begun = cli("rotate", "begin", "--key-format", "mk1", "--json", keystore=ring)
    assert begun.code == 0, begun.err
    info = cli("keys", "show", begun.json()["new"], "--json", keystore=ring).json()
    assert (info["format"], info["budget"], info["budget_from"]) == ("mk1", 2**32, "format")
    listed = cli("keys", "list", "--json", keystore=ring).json()
    assert {k["format"]: k["budget"] for k in listed["keys"]} == {"mk2": 2**40, "mk1": 2**32}


@pytest.mark.parametrize(("text", "value"), [("0.5", 0.5), ("50%", 0.5), ("1", 1.0)])
def test_fractions(text: str, value: float) -> None:
    assert parse_fraction(text) == value
    for bad in ("0", "1.5", "nan", "half"):
        with pytest.raises(ConfigError, match="--if-used-over"):
            parse_fraction(bad)


def test_either_condition_begins_a_rotation_and_neither_gates_one_in_progress() -> None:
    ring = fresh_ring()
    budget = budget_of(ring, ring.primary)
    young, old = T0 + timedelta(days=1), T0 + timedelta(days=31)
    idle = not_due(ring, young, older_than=30 * 86400, used_over=0.5, seals=budget // 4)
    assert idle is not None and not idle.changed
    assert "younger than 30d" in idle.message and "not over 50 %" in idle.message
    assert not_due(ring, old, older_than=30 * 86400, used_over=0.5, seals=0) is None  # old enough
    assert not_due(ring, young, older_than=30 * 86400, used_over=0.5, seals=budget // 2 + 1) is None  # used enough
    unknown = not_due(ring, young, used_over=0.5, seals=None)
    assert unknown is not None and "unknown seal count" in unknown.message
    begun = transition("begin", ring, young).ring
    assert not_due(begun, young, older_than=30 * 86400, used_over=0.5, seals=0) is None  # in progress: continue


@pytest.mark.e2e
def test_if_used_over_alone_without_a_presence_store_exits_2(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    create_ring(FileKeystore(ring))
    res = run_cli("rotate", "next", "--if-used-over", "0.5", keystore=ring, env={"MRTR_KEYS_AUDIT": "off"})
    assert res.code == 2 and "--if-used-over needs fleet-wide seal counts" in res.err, res.err
    both = run_cli(
        "rotate",
        "next",
        "--if-used-over",
        "0.5",
        "--if-older-than",
        "30d",
        keystore=ring,
        env={"MRTR_KEYS_AUDIT": "off"},
    )
    assert both.code == 0 and both.out.startswith("nothing to do") and "only --if-older-than" in both.err
