"""Revoking a key (issue 37): the key ends for good in one generation, a revoked primary is replaced in the
same change, its material leaves the ring unless kept, and every codec refuses its tokens with the reason
``revoked kid``. Times are injected; nothing sleeps."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.audit.ring_changes import change_event
from mrtr_keys.backends import backend_for
from mrtr_keys.changes.apply import apply_change
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.lifecycle import destroy
from mrtr_keys.changes.revoke import revoke
from mrtr_keys.changes.rotation import Phase, status, transition
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.errors import ConfigError, KeyRingError, RotationError, UnknownKid
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.document import parse_ring
from mrtr_keys.ring.model import KeyFormat, KeyRing, KeyState
from tests.fixtures.keyrings import T0, fresh_ring, rotate_through

AUD = "billing"
LATER = T0 + timedelta(hours=1)
BACKEND = backend_for("local")


def _revoke(ring: KeyRing, kid: str, **kw: object) -> KeyRing:
    result = revoke(ring, kid, LATER, reason="ring file in a public bucket", by="ops@host", backend=BACKEND, **kw)  # type: ignore[arg-type]
    assert result.changed and result.ring.generation == ring.generation + 1
    return result.ring


def _refusal(ring: KeyRing, token: str) -> str:
    with pytest.raises(InvalidRequestState) as info:
        LocalAESGCMCodec.from_ring(ring, audience=AUD).unseal(token)
    return str(info.value)


def test_revoking_the_primary_puts_a_new_primary_in_force_in_the_same_generation() -> None:
    ring = fresh_ring()
    old = ring.primary.kid
    token = LocalAESGCMCodec.from_ring(ring, audience=AUD).seal(b"round")
    after = _revoke(ring, old)
    key = after.lookup(old)
    assert key is not None and key.state is KeyState.REVOKED and key.material is None and key.destroyed
    assert (key.revoked_at, key.revoked_reason, key.revoked_by) == (LATER, "ring file in a public bucket", "ops@host")
    assert after.primary.kid != old and after.primary.promoted_at == LATER
    assert status(after, LATER).phase is Phase.IDLE  # no gate to wait for: the new key seals now
    assert _refusal(after, token) == "revoked kid"
    codec = LocalAESGCMCodec.from_ring(after, audience=AUD)
    assert codec.unseal(codec.seal(b"next")) == b"next"


@pytest.mark.parametrize("old_format", [KeyFormat.MK2, KeyFormat.MK1])
def test_the_new_primary_of_a_revocation_is_of_the_format_a_begin_makes(old_format: KeyFormat) -> None:
    """Issue 36: new keys are mk2 (2^48 seals a key). The key that replaces a revoked primary is a new key
    like any other: a revocation must not hand the ring an mk1 key with its 2^32 limit (it did: the backend
    makes mk1 unless told, and only begin told it)."""
    ring = fresh_ring(key_format=old_format)
    after = _revoke(ring, ring.primary.kid)
    assert after.primary.format is KeyFormat.MK2
    codec = LocalAESGCMCodec.from_ring(after, audience=AUD)
    token = codec.seal(b"next")
    assert token.startswith("mk2.") and codec.unseal(token) == b"next"


def test_revoking_the_primary_mid_rotation_promotes_the_key_the_begin_added() -> None:
    begun = rotate_through(fresh_ring()).after_begin
    new = status(begun, LATER).new
    assert new is not None
    after = _revoke(begun, begun.primary.kid)
    assert after.primary.kid == new.kid and after.primary.material == new.material
    assert len(after.keys) == 2 and status(after, LATER).phase is Phase.IDLE


def test_revoking_the_key_a_begin_added_ends_the_rotation() -> None:
    begun = rotate_through(fresh_ring()).after_begin
    new = status(begun, LATER).new
    assert new is not None
    token = LocalAESGCMCodec.from_ring(begun, audience=AUD).seal(b"x")  # the old primary still seals
    after = _revoke(begun, new.kid)
    assert after.primary.kid == begun.primary.kid and status(after, LATER).phase is Phase.IDLE
    assert LocalAESGCMCodec.from_ring(after, audience=AUD).unseal(token) == b"x"
    assert transition("begin", after, LATER).changed  # a new rotation can begin at once


def test_revoking_a_verify_key_after_a_promote_refuses_its_rounds_at_once() -> None:
    gens = rotate_through(fresh_ring())
    old = gens.before_begin.primary.kid
    token = LocalAESGCMCodec.from_ring(gens.before_begin, audience=AUD).seal(b"x")
    assert LocalAESGCMCodec.from_ring(gens.after_promote, audience=AUD).unseal(token) == b"x"
    after = _revoke(gens.after_promote, old)
    assert _refusal(after, token) == "revoked kid"
    assert status(after, LATER).phase is Phase.IDLE  # nothing left to retire


def test_revoking_a_retired_key_removes_its_material_and_records_why() -> None:
    retired = rotate_through(fresh_ring()).after_retire
    old = next(k for k in retired.keys if k.state is KeyState.RETIRED)
    assert old.material is not None  # a retired key still holds it (keys destroy removes it)
    after = _revoke(retired, old.kid)
    key = after.lookup(old.kid)
    assert key is not None and key.revoked and key.material is None and key.destroyed_at == LATER


def test_revoking_a_destroyed_key_records_the_revocation() -> None:
    retired = rotate_through(fresh_ring()).after_retire
    old = next(k for k in retired.keys if k.state is KeyState.RETIRED)
    destroyed = destroy(retired, old.kid, T0 + timedelta(minutes=30)).ring
    result = revoke(destroyed, old.kid, LATER, reason="leak", by="ops", backend=BACKEND)
    assert result.changed and result.details["material"] == "none"
    key = result.ring.lookup(old.kid)
    assert key is not None and key.revoked and key.destroyed_at == T0 + timedelta(minutes=30)


def test_keep_material_keeps_it_and_keys_destroy_removes_it_later() -> None:
    ring = fresh_ring()
    kid = ring.primary.kid
    token = LocalAESGCMCodec.from_ring(ring, audience=AUD).seal(b"x")
    after = _revoke(ring, kid, keep_material=True)
    key = after.lookup(kid)
    assert key is not None and key.material == ring.primary.material and not key.destroyed
    assert _refusal(after, token) == "revoked kid"  # kept is not usable
    gone = destroy(after, kid, LATER).ring.lookup(kid)
    assert gone is not None and gone.revoked and gone.material is None


def test_a_revocation_is_final_and_a_second_one_changes_nothing() -> None:
    ring = fresh_ring()
    kid = ring.primary.kid
    after = _revoke(ring, kid)
    again = revoke(after, kid, LATER + timedelta(hours=1), reason="again", by="ops", backend=BACKEND)
    assert not again.changed and again.ring == after and "already revoked" in again.message


def test_an_unknown_kid_is_refused_with_exit_1() -> None:
    with pytest.raises(UnknownKid, match="no key 00000000 in key ring") as info:
        revoke(fresh_ring(), "00000000", LATER, reason="leak", by="ops", backend=BACKEND)
    assert info.value.exit_code == 1


@pytest.mark.parametrize("reason", ["", "   ", "two\nlines", "x" * 501])
def test_a_reason_is_one_line_of_text(reason: str) -> None:
    ring = fresh_ring()
    with pytest.raises(ConfigError, match="--reason"):
        revoke(ring, ring.primary.kid, LATER, reason=reason, by="ops", backend=BACKEND)


def test_the_revoked_state_round_trips_and_is_checked_when_read() -> None:
    ring = fresh_ring()
    after = _revoke(ring, ring.primary.kid)
    assert parse_ring(after.dumps()) == after
    doc = json.loads(after.dumps())
    entry = next(k for k in doc["keys"] if k["state"] == "revoked")
    assert entry["revoked_reason"] == "ring file in a public bucket" and "material" not in entry
    entry.pop("revoked_at")
    with pytest.raises(KeyRingError, match="a revoked key needs revoked_at"):
        parse_ring(json.dumps(doc))
    doc = json.loads(after.dumps())
    doc["keys"][-1]["revoked_by"] = "ops"  # on the (primary) key that is not revoked
    with pytest.raises(KeyRingError, match="belong to a revoked key"):
        parse_ring(json.dumps(doc))


def test_the_audit_record_is_a_ring_change_with_its_reason(tmp_path: Path) -> None:
    store = FileKeystore(tmp_path / "keyring.json")
    ring = create_ring(store, audiences=(AUD,)).ring
    result = apply_change(
        store,
        "revoke",
        lambda r, now: revoke(r, ring.primary.kid, now, reason="core dump shared", by="ops@h", backend=BACKEND),
    )
    event = change_event(result)
    assert (event.op, event.kid, event.reason, event.generation) == (
        "revoke",
        ring.primary.kid,
        "core dump shared",
        2,
    )
    assert store.load().lookup(ring.primary.kid).state is KeyState.REVOKED  # type: ignore[union-attr]


def test_a_retire_waiting_while_the_old_key_was_revoked_is_done_not_an_error() -> None:
    """The pipeline's ``rotate next --wait`` resolved to retire and waits for the TTL; an operator revokes the old
    key meanwhile. The retire's end (the old key out of use, the new one alone) holds, so the step reports done
    and writes nothing, as after a retire; it exited 1 ("nothing to retire"), failing the pipeline's job
    (issue 40's chaos run: three rotation jobs in ten minutes)."""
    gens = rotate_through(fresh_ring())
    old = gens.before_begin.primary.kid
    after = _revoke(gens.after_promote, old)
    done = transition("retire", after, LATER + timedelta(hours=1))
    assert not done.changed and done.ring is after
    assert done.message == f"already out of use: {old} was revoked; {after.primary.kid} is the only key in use"


def test_a_promote_waiting_while_the_sealing_key_was_revoked_is_done_when_the_begun_key_took_over() -> None:
    """Revoking the primary mid-rotation promotes the key the begin added (above): a promote waiting for the
    fleet then finds its work done. Revoking the begun key instead ends the rotation: that promote is refused."""
    begun = rotate_through(fresh_ring()).after_begin
    new = status(begun, LATER).new
    assert new is not None
    took_over = _revoke(begun, begun.primary.kid)
    done = transition("promote", took_over, LATER)
    assert not done.changed and done.ring is took_over
    assert done.message == (
        f"already promoted: {new.kid} seals since {begun.primary.kid} was revoked; the rotation is complete"
    )
    with pytest.raises(RotationError, match="nothing to promote"):
        transition("promote", _revoke(begun, new.kid), LATER)


def test_a_retire_waiting_while_its_old_key_was_revoked_and_a_rotation_began_since_is_done() -> None:
    """Issue 40's fourth 60-minute run (seed 2026): the pipeline's ``rotate next --wait`` resolved to retire the old
    key and waited; the new primary was revoked (a fresh key took over), then the old key too, and another job's
    ``rotate next`` began a rotation while a keystore cut kept the waiter from looking. The waiter then exited 1
    ("the new key is not sealing yet ... run: mrtr-keys rotate promote"), though its end held: the old key is out
    of use. It reports done and writes nothing; a retire with nothing revoked in a begun rotation is still refused."""
    gens = rotate_through(fresh_ring())
    promoted = gens.after_promote
    old, new = status(promoted, LATER).old, promoted.primary
    assert old is not None
    without_new = _revoke(promoted, new.kid)
    without_both = _revoke(without_new, old.kid)
    begun = transition("begin", without_both, LATER + timedelta(minutes=5)).ring
    assert status(begun, LATER + timedelta(minutes=5)).phase is Phase.BEGUN
    begun_kid = status(begun, LATER + timedelta(minutes=5)).new
    assert begun_kid is not None
    done = transition("retire", begun, LATER + timedelta(minutes=6))
    assert not done.changed and done.ring is begun
    assert done.message == (
        f"already out of use: {old.kid} was revoked; a rotation has begun since ({begun_kid.kid} verifies); "
        "next: mrtr-keys rotate promote"
    )
    with pytest.raises(RotationError, match="not sealing yet"):
        transition("retire", gens.after_begin, LATER)
