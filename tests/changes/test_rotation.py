"""Three-phase rotation (the MCP SDK docs' zero-downtime rotation, quoted in
`mcp.server.request_state.RequestStateSecurity`): begin, promote, retire after TTL + 60 s.

Times are injected (`now=`), so nothing here sleeps.
"""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path

import pytest
from mcp.server import request_state as sdk
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.backends import backend_for
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import FUTURE_SKEW_SECONDS, Phase, begin, promote, retire, run_step, status, transition
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.errors import ConfigError, NotYet, RotationError
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import KeyRing, KeyState
from tests.fixtures.keyrings import T0, fresh_ring, rotate_through

AUD = "billing"
GENS = ("before_begin", "after_begin", "after_promote", "after_retire")
OK, NO = True, False
# EXPECTED[minted at][unsealed at]. Minting at phase 0/1 uses OLD, at phase 2/3 NEW.
# OLD verifies until retired; NEW verifies from begin on. Adjacent phases (the ones that
# coexist in a fleet mid-rollout) always pass.
EXPECTED = {
    "before_begin": {"before_begin": OK, "after_begin": OK, "after_promote": OK, "after_retire": NO},
    "after_begin": {"before_begin": OK, "after_begin": OK, "after_promote": OK, "after_retire": NO},
    "after_promote": {"before_begin": NO, "after_begin": OK, "after_promote": OK, "after_retire": OK},
    "after_retire": {"before_begin": NO, "after_begin": OK, "after_promote": OK, "after_retire": OK},
}
GENERATIONS = rotate_through(fresh_ring())


def _codec(gen: str) -> LocalAESGCMCodec:
    return LocalAESGCMCodec.from_ring(getattr(GENERATIONS, gen), audience=AUD)  # type: ignore[return-value]


@pytest.mark.parametrize("unsealed_at", GENS)
@pytest.mark.parametrize("minted_at", GENS)
def test_rotation_matrix(minted_at: str, unsealed_at: str) -> None:
    """A token minted by an instance at one generation, unsealed by an instance at another."""
    payload = f"minted at {minted_at}".encode()
    token = _codec(minted_at).seal(payload)
    codec = _codec(unsealed_at)
    if EXPECTED[minted_at][unsealed_at]:
        assert codec.unseal(token) == payload
    else:
        with pytest.raises(InvalidRequestState) as info:
            codec.unseal(token)
        # Before begin NEW is unknown; after retire OLD is known but retired.
        assert str(info.value) == ("unknown kid" if unsealed_at == "before_begin" else "retired kid")


def test_the_four_generations_have_the_states_the_phases_define() -> None:
    g = GENERATIONS
    old, new = g.before_begin.primary.kid, g.after_promote.primary.kid
    states = [{k.kid: k.state.value for k in ring.keys} for ring in g.all]
    assert states == [
        {old: "primary"},
        {old: "primary", new: "verify"},
        {old: "verify", new: "primary"},
        {old: "retired", new: "primary"},
    ]
    assert [ring.generation for ring in g.all] == [1, 2, 3, 4]


def test_the_retire_gate_is_the_sdk_future_skew_after_ttl() -> None:
    """Phase 3 waits TTL + 60 s: 60 s is the SDK's `_FUTURE_SKEW` (tokens minted up to 60 s ahead)."""
    assert FUTURE_SKEW_SECONDS == sdk._FUTURE_SKEW


# Transitions, one rule each; `now` is injected.

RING = fresh_ring(ttl=600.0)
LOCAL = backend_for("local")
T_BEGIN, T_PROMOTE = T0 + timedelta(minutes=1), T0 + timedelta(minutes=2)
GATE = T_PROMOTE + timedelta(seconds=600 + 60)


def _begun() -> KeyRing:
    return begin(RING, T_BEGIN, LOCAL).ring


def _promoted() -> KeyRing:
    return promote(_begun(), T_PROMOTE).ring


def test_begin_adds_one_verify_key_and_the_old_key_still_seals() -> None:
    result = begin(RING, T_BEGIN, LOCAL)
    assert result.changed and result.ring.generation == RING.generation + 1
    new = result.ring.lookup(result.details["new"])
    assert new is not None and new.state is KeyState.VERIFY and new.created_at == T_BEGIN
    assert result.ring.primary == RING.primary
    assert "mrtr-keys rotate promote" in result.message


def test_begin_twice_is_a_no_op_that_says_already_begun() -> None:
    """A deploy pipeline may rerun a step; rerunning begin adds nothing."""
    ring = _begun()
    again = begin(ring, T_BEGIN + timedelta(seconds=5), LOCAL)
    assert not again.changed and again.ring is ring and len(again.ring.keys) == 2
    assert "already begun" in again.message


def test_promote_with_no_rotation_is_refused_naming_begin() -> None:
    with pytest.raises(RotationError, match="mrtr-keys rotate begin"):
        promote(RING, T_PROMOTE)


def test_promote_swaps_primary_and_records_the_times() -> None:
    before = _begun()
    ring = promote(before, T_PROMOTE).ring
    old = ring.lookup(RING.primary.kid)
    assert old is not None and old.state is KeyState.VERIFY and old.demoted_at == T_PROMOTE
    assert ring.primary.kid != RING.primary.kid and ring.primary.promoted_at == T_PROMOTE
    again = promote(ring, T_PROMOTE + timedelta(seconds=1))
    assert not again.changed and "already promoted" in again.message


def test_begin_after_promote_is_refused_naming_retire() -> None:
    with pytest.raises(RotationError, match="mrtr-keys rotate retire"):
        begin(_promoted(), T_PROMOTE, LOCAL)


def test_retire_before_promote_is_refused_naming_promote() -> None:
    with pytest.raises(RotationError, match="mrtr-keys rotate promote"):
        retire(_begun(), GATE)
    with pytest.raises(RotationError, match="mrtr-keys rotate begin"):
        retire(RING, GATE)


@pytest.mark.parametrize("early_by", [660.0, 61.0, 1.5, 1e-6])
def test_retire_before_the_gate_is_not_yet_and_says_how_long(early_by: float) -> None:
    now = GATE - timedelta(seconds=early_by)
    with pytest.raises(NotYet) as info:
        retire(_promoted(), now)
    assert info.value.exit_code == 75
    assert info.value.wait_seconds == pytest.approx(early_by)
    assert f"waiting {math.ceil(early_by)} s more" in str(info.value)
    assert "TTL 600 s + 60 s" in str(info.value)


def test_retire_at_the_gate_is_allowed() -> None:
    result = retire(_promoted(), GATE)
    old = result.ring.lookup(RING.primary.kid)
    assert result.changed and not result.forced
    assert old is not None and old.state is KeyState.RETIRED and old.retired_at == GATE
    again = retire(result.ring, GATE + timedelta(hours=1))
    assert not again.changed and "already retired" in again.message


def test_forced_retire_says_what_it_risks() -> None:
    result = retire(_promoted(), T_PROMOTE + timedelta(seconds=10), force=True)
    assert result.changed and result.forced
    assert "forced 650 s before the TTL gate" in result.message
    assert "now rejected" in result.message


def test_next_walks_the_phases_and_waits_at_the_gate() -> None:
    ring = RING
    ring = transition("next", ring, T_BEGIN).ring
    assert status(ring, T_BEGIN).phase is Phase.BEGUN
    ring = transition("next", ring, T_PROMOTE).ring
    assert status(ring, T_PROMOTE).phase is Phase.PROMOTED
    with pytest.raises(NotYet):
        transition("next", ring, GATE - timedelta(seconds=1))
    ring = transition("next", ring, GATE).ring
    assert [k.state for k in ring.keys] == [KeyState.RETIRED, KeyState.PRIMARY]


def test_status_reports_phase_next_step_and_wait() -> None:
    assert status(RING, T0).to_json()["next_step"] == "begin"
    st = status(_promoted(), GATE - timedelta(seconds=30)).to_json()
    assert st["phase"] == "promoted" and st["phase_number"] == 2 and st["next_step"] == "retire"
    assert st["wait_seconds"] == 30.0 and st["retire_at"] == "2026-11-01T12:13:00Z"


def test_begin_with_a_ttl_stores_it_and_moves_the_gate() -> None:
    """The TTL comes from --ttl and is stored in the ring."""
    ring = begin(RING, T_BEGIN, LOCAL, ttl=30).ring
    assert ring.ttl_seconds == 30.0
    ring = promote(ring, T_PROMOTE).ring
    with pytest.raises(NotYet):
        retire(ring, T_PROMOTE + timedelta(seconds=89))
    assert retire(ring, T_PROMOTE + timedelta(seconds=90)).changed
    for bad in (0, -1, math.nan, math.inf):
        with pytest.raises(ConfigError):
            begin(RING, T_BEGIN, LOCAL, ttl=bad)


def test_a_second_rotation_after_retire_starts_cleanly() -> None:
    g = rotate_through(fresh_ring())
    second = rotate_through(g.after_retire, start=T0 + timedelta(hours=1))
    states = sorted(k.state.value for k in second.after_retire.keys)
    assert states == ["primary", "retired", "retired"]
    assert second.after_retire.generation == 7


def test_run_step_on_a_keystore_is_allowed_after_the_gate(tmp_path: Path) -> None:
    """The library path the CLI takes (lock, load, transform, CAS save), with an injected clock."""
    store = FileKeystore(tmp_path / "ring.json")
    create_ring(store, ttl=1.0, now=T0)
    token_old = LocalAESGCMCodec(store, audience=AUD).seal(b"in flight")
    run_step(store, "begin", now=T0 + timedelta(seconds=1))
    run_step(store, "promote", now=T0 + timedelta(seconds=2))
    with pytest.raises(NotYet) as info:
        run_step(store, "retire", now=T0 + timedelta(seconds=62.5))
    assert info.value.wait_seconds == pytest.approx(0.5)
    assert store.load().generation == 3, "a refused step writes nothing"
    assert LocalAESGCMCodec(store, audience=AUD).unseal(token_old) == b"in flight"
    result = run_step(store, "next", now=T0 + timedelta(seconds=63))
    assert result.op == "retire" and result.changed and store.load().generation == 4
    with pytest.raises(InvalidRequestState):
        LocalAESGCMCodec(store, audience=AUD).unseal(token_old)
