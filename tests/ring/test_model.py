"""The key ring document and its invariants : versioned JSON, unique kids,
exactly one primary, 32 bytes of material stored as standard base64, and errors that never echo
key material (our rule: no secret in an exception message or a repr)."""

from __future__ import annotations

import base64
import json
from dataclasses import replace

import pytest

from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.errors import KeyRingError
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.document import parse_ring, ring_from_json
from mrtr_keys.ring.model import KeyState
from tests.fixtures.keyrings import bad_rings, fresh_ring, rotate_through

CONTENT_CASES = [b for b in bad_rings() if b.mode == 0o600]


@pytest.mark.parametrize("bad", CONTENT_CASES, ids=[b.id for b in CONTENT_CASES])
def test_bad_documents_fail_with_one_line_that_never_echoes_material(bad) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KeyRingError) as info:
        ring_from_json(bad.doc)
    message = str(info.value)
    assert bad.expect in message
    assert "\n" not in message
    for material in bad.material:
        assert material not in message
        assert material[:12] not in message


def test_a_round_trip_through_json_is_lossless() -> None:
    ring = rotate_through(fresh_ring(audiences=["billing"], ttl=30)).after_promote
    again = parse_ring(ring.dumps())
    assert again == ring
    doc = json.loads(ring.dumps())
    assert doc["format"] == "mrtr-keys.keyring" and doc["version"] == 1 and doc["generation"] == 3
    assert {k["state"] for k in doc["keys"]} == {"primary", "verify"}
    for k in doc["keys"]:
        assert len(base64.b64decode(k["material"], validate=True)) == 32
        assert k["created_at"].endswith("Z")


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        (lambda d: d.update(format="x"), "not a key ring document"),
        (lambda d: d.update(version=2), "unsupported key ring version 2"),
        (lambda d: d.update(generation="3"), "generation must be an integer"),
        (lambda d: d.update(generation=0), "generation must be between 1 and"),
        (lambda d: d.update(generation=2**63), "generation must be between 1 and"),
        (lambda d: d.update(ttl_seconds=1e308), "ttl_seconds must be"),
        (lambda d: d.update(ttl_seconds=-1), "ttl_seconds"),
        (lambda d: d.update(audiences=["a", "a"]), "duplicate"),
        (lambda d: d["keys"][0].update(kid="ABCDEF12"), "8 lowercase hex"),
        (lambda d: d["keys"][0].update(state="active"), "verify, primary, retired or revoked"),
        (lambda d: d["keys"][0].pop("material"), "missing material"),
        (lambda d: d["keys"][0].update(material=d["keys"][0]["material"].rstrip("=")), "base64 of 32 bytes"),
        (lambda d: d["keys"][0].update(created_at="yesterday"), "ISO 8601"),
    ],
)
def test_other_invalid_documents_are_refused(change, expect: str) -> None:  # type: ignore[no-untyped-def]
    doc = fresh_ring().to_json()
    material = doc["keys"][0]["material"]
    change(doc)
    with pytest.raises(KeyRingError, match=expect) as info:
        ring_from_json(doc)
    assert material not in str(info.value)


def test_not_json_is_one_line() -> None:
    with pytest.raises(KeyRingError, match="not valid JSON"):
        parse_ring(b"{not json")


def test_constructing_a_ring_in_code_enforces_exactly_one_primary() -> None:
    ring = fresh_ring()
    with pytest.raises(KeyRingError, match="no primary"):
        replace(ring, keys=(replace(ring.primary, state=KeyState.VERIFY),))
    with pytest.raises(KeyRingError, match="duplicate kid"):
        replace(ring, keys=(ring.primary, replace(ring.primary, state=KeyState.VERIFY)))


def test_describe_never_contains_material() -> None:
    ring = rotate_through(fresh_ring()).after_promote
    text = json.dumps(ring.describe())
    for k in ring.keys:
        assert k.material is not None
        assert base64.b64encode(k.material).decode() not in text


def test_repr_of_ring_key_codec_and_keystore_shows_no_material(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Our rule: no secret in a repr()."""
    ring = rotate_through(fresh_ring()).after_promote
    store = FileKeystore(tmp_path / "ring.json")
    store.create(ring)
    codec = LocalAESGCMCodec(store, audience="billing")
    core = codec._core
    text = " ".join(
        repr(x) for x in (ring, *ring.keys, codec, core, store, LocalAESGCMCodec.from_ring(ring, audience="a"))
    )
    text += str(ring) + str(codec)
    assert ring.primary.kid in text, "the reprs are informative: they name kids"
    for k in ring.keys:
        assert k.material is not None
        for spelling in (base64.b64encode(k.material).decode(), k.material.hex(), repr(k.material)):
            assert spelling not in text


def test_a_ring_without_created_at_is_refused_not_dated_now() -> None:
    """Our decision: a missing creation time is a broken document; filling in "now" would hide it."""
    doc = fresh_ring().to_json()
    del doc["created_at"]
    with pytest.raises(KeyRingError, match="created_at is required"):
        ring_from_json(doc)
    doc["created_at"] = None
    with pytest.raises(KeyRingError, match="created_at is required"):
        ring_from_json(doc)
