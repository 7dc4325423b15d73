"""Rings adopted from the MCP SDK's ``RequestStateSecurity(keys=[KEY])``: the SDK key mints and
opens exactly the SDK's ``v1.`` tokens (its own codec class does the cryptography), the ordinary rotation
moves the ring to ``mk1.``, and every failure is `InvalidRequestState` with a reason code."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
from mcp.server.request_state import AESGCMRequestStateCodec, InvalidRequestState

from mrtr_keys.changes.create import create_ring, create_ring_from_sdk_keys
from mrtr_keys.changes.rotation import Phase, run_step, status
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.errors import AudienceError, KeyRingError, MrtrKeysError
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.document import parse_ring
from mrtr_keys.ring.model import KeyFormat, KeyState
from tests.fixtures.codec_contract import tampered
from tests.fixtures.sdk_keys import envelope, key_secrets, new_sdk_key, sdk_ring

AUD = "provisioner"


def reason(codec: object, token: object) -> str:
    with pytest.raises(InvalidRequestState) as info:
        codec.unseal(token)  # type: ignore[attr-defined]
    return str(info.value)


def test_the_sdks_codec_and_the_adopted_ring_read_each_others_tokens(tmp_path: Path) -> None:
    """Old and new instances read each other's tokens in both directions."""
    key = new_sdk_key()
    sdk, ours = AESGCMRequestStateCodec([key]), LocalAESGCMCodec(sdk_ring(tmp_path / "r.json", key), audience=AUD)
    payload = envelope(b"state", AUD)
    assert ours.unseal(sdk.seal(payload)) == payload
    token = ours.seal(payload)
    assert token.startswith("v1.") and sdk.unseal(token) == payload


def test_an_sdk_format_key_binds_the_audience_through_the_envelope(tmp_path: Path) -> None:
    """The v1. format has no audience of its own (the SDK checks the envelope's aud claim); the codec
    refuses a token for another audience, and seals only envelopes for its own."""
    key = new_sdk_key()
    store = sdk_ring(tmp_path / "r.json", key)
    ours = LocalAESGCMCodec(store, audience=AUD)
    sdk = AESGCMRequestStateCodec([key])
    assert reason(ours, sdk.seal(envelope(b"x", "billing"))) == "audience"
    assert reason(ours, sdk.seal(b"not an envelope")) == "audience"
    for payload in (b"not an envelope", envelope(b"x", "billing"), b"[1]"):
        with pytest.raises(MrtrKeysError, match="seals only MCP SDK envelopes"):
            ours.seal(payload)
    assert LocalAESGCMCodec(store, audience="billing").unseal(sdk.seal(envelope(b"x", "billing")))
    # A ring scoped to audiences refuses to open a codec for any other, whatever its keys' format.
    scoped = FileKeystore(tmp_path / "scoped.json")
    create_ring_from_sdk_keys(scoped, [key], audiences=[AUD])
    with pytest.raises(AudienceError, match="outside this key ring's scope"):
        LocalAESGCMCodec(scoped, audience="billing")


@pytest.mark.parametrize("fmt", ["mk2", "mk1"])
def test_rotation_moves_the_ring_from_v1_to_mk_tokens_with_reason_codes(tmp_path: Path, fmt: str) -> None:
    """begin: still v1.; promote: mk2. (or, with --key-format mk1, mk1.) seals, v1. opens; retire: v1. is
    `retired kid`."""
    key = new_sdk_key()
    store = sdk_ring(tmp_path / "r.json", key)
    sdk = AESGCMRequestStateCodec([key])
    body = envelope(b"s", AUD)
    old = sdk.seal(body)
    begun = run_step(store, "begin", key_format=fmt)
    codec = LocalAESGCMCodec(store, audience=AUD)
    assert codec.seal(body).startswith("v1.") and codec.unseal(old) == body
    promoted = run_step(store, "promote")
    assert codec.reload()
    new = codec.seal(body)
    assert new.startswith(f"{fmt}.") and codec.unseal(new) == body and codec.unseal(old) == body
    # A v1. token relabelled with the new key's kid, and a new token with the SDK kid: refused by kid.
    v1_raw, mk_raw = old[3:], new[4:]
    new_kid_b64 = LocalAESGCMCodec(store, audience=AUD).seal(body)[4:10]
    assert reason(codec, "v1." + new_kid_b64 + v1_raw[6:]) == "other format"
    assert reason(codec, f"{fmt}." + v1_raw[:6] + mk_raw[6:]) == "unknown kid"
    run_step(store, "retire", now=promoted.ring.primary.promoted_at + timedelta(seconds=661))  # type: ignore[operator]
    assert codec.reload()
    assert reason(codec, old) == "retired kid" and reason(codec, tampered(codec.seal(body))) == "seal"
    assert codec.unseal(new) == body
    assert begun.details["new"] == codec.ring.primary.kid


def test_several_sdk_keys_import_as_old_keys_retired_together(tmp_path: Path) -> None:
    """keys=[k0, k1, k2]: k0 seals; k1 and k2 verify, demoted, so the ring starts at phase 2 of a rotation
    away from them; `retire` (after TTL + 60 s) retires both, then an ordinary rotation can begin."""
    k0, k1, k2 = new_sdk_key(), new_sdk_key(), new_sdk_key()
    store = sdk_ring(tmp_path / "r.json", k0, k1, k2, ttl=60)
    ring = store.load()
    assert [(k.state, k.format) for k in ring.keys] == [(KeyState.PRIMARY, KeyFormat.SDK_V1)] + [
        (KeyState.VERIFY, KeyFormat.SDK_V1)
    ] * 2
    assert status(ring, ring.created_at).phase is Phase.PROMOTED
    codec = LocalAESGCMCodec(store, audience=AUD)
    from_k2 = AESGCMRequestStateCodec([k2, k0]).seal(envelope(b"s", AUD))
    assert json.loads(codec.unseal(from_k2))["s"] == "s"
    run_step(store, "retire", now=ring.created_at + timedelta(seconds=121))
    assert [k.state for k in store.load().keys] == [KeyState.PRIMARY, KeyState.RETIRED, KeyState.RETIRED]
    codec.reload()
    assert reason(codec, from_k2) == "retired kid"
    assert run_step(store, "begin").changed


def test_a_revoked_sdk_key_is_replaced_by_an_mk2_primary_and_its_v1_tokens_say_revoked_kid(tmp_path: Path) -> None:
    """Issue 37: revoking the SDK key that seals makes a new primary in the same generation, of the format a
    begin makes (mk2, issue 36); the SDK's own tokens under the revoked key are refused with the reason
    ``revoked kid``."""
    from mrtr_keys.backends import backend_for
    from mrtr_keys.changes.apply import apply_change
    from mrtr_keys.changes.revoke import revoke

    key = new_sdk_key()
    store = sdk_ring(tmp_path / "r.json", key)
    old = AESGCMRequestStateCodec([key]).seal(envelope(b"s", AUD))
    codec = LocalAESGCMCodec(store, audience=AUD)
    kid = store.load().primary.kid
    apply_change(
        store, "revoke", lambda r, now: revoke(r, kid, now, reason="leak", by="ops", backend=backend_for("local"))
    )
    assert codec.reload()
    assert reason(codec, old) == "revoked kid"
    assert codec.seal(b"x").startswith("mk2.") and store.load().lookup(kid).material is None  # type: ignore[union-attr]


def test_ring_documents_stay_backward_compatible_and_hold_sdk_keys_apart(tmp_path: Path) -> None:
    """A ring of mk1 keys is written as before (no format field) and old documents load as mk1;
    an SDK key is stored as sdk_key, never as material, so a build without formats refuses the ring."""
    plain = FileKeystore(tmp_path / "plain.json")
    create_ring(plain, key_format="mk1")
    doc = json.loads((tmp_path / "plain.json").read_text())
    assert "format" not in doc["keys"][0] and "sdk_key" not in doc["keys"][0]
    assert plain.load().primary.format is KeyFormat.MK1
    key = new_sdk_key()
    sdk_ring(tmp_path / "sdk.json", key)
    entry = json.loads((tmp_path / "sdk.json").read_text())["keys"][0]
    assert entry["format"] == "sdk-v1" and "material" not in entry and "sdk_key" in entry


def _bad(doc: dict[str, object]) -> str:
    with pytest.raises(KeyRingError) as info:
        parse_ring(json.dumps(doc))
    return str(info.value)


def test_broken_sdk_keys_in_a_ring_are_refused_without_echoing_them(tmp_path: Path) -> None:
    key = os.urandom(32)
    sdk_ring(tmp_path / "sdk.json", key)
    good = json.loads((tmp_path / "sdk.json").read_text())
    entry = good["keys"][0]
    cases = {
        "format": ({**entry, "format": "v2"}, "format must be mk1, mk2 or sdk-v1"),
        "short": ({**entry, "sdk_key": "QUFB"}, "decodes to 3 bytes"),
        "material": ({**entry, "material": entry["sdk_key"]}, "only in a local ring"),
        "stray": ({**entry, "format": "mk1"}, "sdk_key belongs to an sdk-v1 key"),
    }
    for doc_entry, fragment in cases.values():
        message = _bad({**good, "keys": [doc_entry]})
        assert fragment in message
        for secret in key_secrets(key):
            assert secret not in message
    assert "only in a local ring" in _bad({**good, "codec": {"type": "kms"}})
    # An edited kid: the codec refuses to build rather than mint tokens the SDK would file under another kid.
    (tmp_path / "edited.json").write_text(json.dumps({**good, "keys": [{**entry, "kid": "00000000"}]}))
    (tmp_path / "edited.json").chmod(0o600)
    with pytest.raises(KeyRingError, match="not the one the MCP SDK derives"):
        LocalAESGCMCodec(tmp_path / "edited.json", audience=AUD)


def test_no_sdk_key_in_repr_or_description(tmp_path: Path) -> None:
    key = new_sdk_key()
    store = sdk_ring(tmp_path / "r.json", key)
    run_step(store, "begin")
    ring = store.load()
    text = repr(ring) + repr(ring.keys) + json.dumps(ring.describe()) + repr(LocalAESGCMCodec(store, audience=AUD))
    for secret in key_secrets(key):
        assert secret not in text
    assert "sdk-v1" in json.dumps(ring.describe())
