"""KMSEnvelopeCodec against moto in server mode: unwrap once, seal/unseal locally, fail closed."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.changes import scope
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs.kms import KMSEnvelopeCodec
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.errors import AudienceError, UnwrapError
from mrtr_keys.factory import open_codec, request_state_security
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.providers.kms.wrapped import WrappedKey
from mrtr_keys.ring.model import CodecSpec, Key, KeyRing
from tests.fixtures.moto_kms import KMSEnv


def make_ring(tmp_path: Path, key_arn: str, name: str = "ring.json", audiences: tuple[str, ...] = ()) -> FileKeystore:
    store = FileKeystore(tmp_path / name)
    create_ring(store, codec=CodecSpec("kms", {"kms_key_id": key_arn}), audiences=audiences)
    return store


def edit(store: FileKeystore, change: Any) -> None:
    """Edit the stored document in place, as someone with write access to the file could."""
    doc = json.loads(store.path.read_text())
    change(doc)
    store.path.write_text(json.dumps(doc))


def test_init_stores_only_the_wrapped_key_and_its_context(kms: KMSEnv, tmp_path: Path) -> None:
    # The ring holds CiphertextBlob, the key ARN and the encryption context, no material.
    arn = kms.create_key()
    store = make_ring(tmp_path, arn, audiences=("search", "billing"))
    doc = json.loads(store.path.read_text())
    (key,) = doc["keys"]
    assert "material" not in key
    data = key["key_data"]
    assert data["kms_key_arn"] == arn
    assert list(data["encryption_context"].items()) == [
        ("mrtr:ring", doc["ring_id"]),
        ("mrtr:kid", key["kid"]),
        ("mrtr:audiences", "billing,search"),
    ]
    assert base64.b64decode(data["ciphertext_blob"], validate=True)
    assert doc["codec"] == {"type": "kms", "kms_key_id": arn}
    assert kms.proxy.calls == {"DescribeKey": 1, "GenerateDataKey": 1}  # init judges the key, then makes one


def test_unscoped_ring_context_has_ring_and_kid_only(kms: KMSEnv, tmp_path: Path) -> None:
    store = make_ring(tmp_path, kms.create_key())
    (key,) = json.loads(store.path.read_text())["keys"]
    assert list(key["key_data"]["encryption_context"]) == ["mrtr:ring", "mrtr:kid"]


def test_round_trip_and_no_kms_call_per_token(kms: KMSEnv, tmp_path: Path) -> None:
    # Load unwraps each usable key once; 10,000 seal+unseal pairs then make no KMS request.
    store = make_ring(tmp_path, kms.create_key())
    run_step(store, "begin")  # two usable data keys: primary + verify
    kms.proxy.reset()
    codec = KMSEnvelopeCodec(store, audience="svc")
    for i in range(10_000):
        payload = f"state-{i}".encode()
        assert codec.unseal(codec.seal(payload)) == payload
    assert kms.proxy.calls == {"Decrypt": 2}
    assert kms.proxy.count == len(store.load().usable_keys()) == 2


def test_request_state_security_picks_the_kms_codec_from_the_ring(kms: KMSEnv, tmp_path: Path) -> None:
    store = make_ring(tmp_path, kms.create_key())
    security = request_state_security(store.path, audience="svc")
    assert isinstance(security.codec, KMSEnvelopeCodec)
    assert security.codec.unseal(security.codec.seal(b"x")) == b"x"


def test_token_for_another_audience_is_refused(kms: KMSEnv, tmp_path: Path) -> None:
    store = make_ring(tmp_path, kms.create_key())
    a = KMSEnvelopeCodec(store, audience="a")
    b = KMSEnvelopeCodec(store, audience="b")
    with pytest.raises(InvalidRequestState):
        b.unseal(a.seal(b"x"))


def test_same_token_format_as_the_local_codec(kms: KMSEnv, tmp_path: Path) -> None:
    # One implementation of the token format: a KMS data key in a local ring opens the same tokens.
    store = make_ring(tmp_path, kms.create_key())
    codec = KMSEnvelopeCodec(store, audience="svc")
    ring = codec.ring
    material = codec._unwrapped[next(iter(codec._unwrapped))]
    primary = ring.primary
    local_key = Key(
        kid=primary.kid, state=primary.state, created_at=primary.created_at, material=material, format=primary.format
    )
    local_ring = KeyRing(ring_id=ring.ring_id, generation=1, keys=(local_key,))
    local = LocalAESGCMCodec.from_ring(local_ring, audience="svc")
    token = codec.seal(b"same format")
    assert token.startswith("mk2.")
    assert local.unseal(token) == b"same format"


# --- failure behaviour: a wrapped key that does not belong here never unwraps -----------------------


def test_wrapped_key_moved_into_another_ring_does_not_unwrap(kms: KMSEnv, tmp_path: Path) -> None:
    # A data key copied into another ring (other ring id) fails; the untouched ring loads.
    arn = kms.create_key()
    donor, victim = make_ring(tmp_path, arn, "a.json"), make_ring(tmp_path, arn, "b.json")
    donor_key = json.loads(donor.path.read_text())["keys"][0]

    def transplant(doc: dict[str, Any]) -> None:
        doc["keys"][0]["key_data"] = donor_key["key_data"]

    edit(victim, transplant)
    with pytest.raises(UnwrapError, match=r"EncryptionContextMismatch.*mrtr:ring"):
        KMSEnvelopeCodec(victim, audience="svc")

    # Same, with the recorded context also rewritten to the victim's: KMS itself refuses the blob.
    def relabel(doc: dict[str, Any]) -> None:
        doc["keys"][0]["kid"] = donor_key["kid"]
        ctx = doc["keys"][0]["key_data"]["encryption_context"]
        ctx["mrtr:ring"] = doc["ring_id"]

    edit(victim, relabel)
    kid = donor_key["kid"]
    with pytest.raises(UnwrapError, match=rf"key {kid}: cannot unwrap: InvalidCiphertextException"):
        KMSEnvelopeCodec(victim, audience="svc")
    assert KMSEnvelopeCodec(donor, audience="svc").seal(b"x").startswith("mk2.")


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda ctx: ctx.update({"mrtr:kid": "00000000"}), id="pair-changed"),
        pytest.param(lambda ctx: ctx.pop("mrtr:audiences"), id="pair-removed"),
        pytest.param(lambda ctx: ctx.update({"team": "x"}), id="pair-added"),
    ],
)
def test_edited_encryption_context_does_not_unwrap(kms: KMSEnv, tmp_path: Path, change: Any) -> None:
    arn = kms.create_key()
    edited = make_ring(tmp_path, arn, "edited.json", audiences=("svc",))
    untouched = make_ring(tmp_path, arn, "untouched.json", audiences=("svc",))
    kid = edited.load().primary.kid
    edit(edited, lambda doc: change(doc["keys"][0]["key_data"]["encryption_context"]))
    with pytest.raises(UnwrapError, match=rf"key {kid}: cannot unwrap: EncryptionContextMismatch"):
        KMSEnvelopeCodec(edited, audience="svc")
    assert (
        KMSEnvelopeCodec(untouched, audience="svc").unseal(KMSEnvelopeCodec(untouched, audience="svc").seal(b"ok"))
        == b"ok"
    )


def test_scope_edited_in_the_file_does_not_unwrap(kms: KMSEnv, tmp_path: Path) -> None:
    # The scope is bound by KMS: widening it by editing both the ring and the recorded context fails at KMS.
    store = make_ring(tmp_path, kms.create_key(), audiences=("billing",))
    kid = store.load().primary.kid

    def widen(doc: dict[str, Any]) -> None:
        doc["audiences"] = ["billing", "intruder"]
        doc["keys"][0]["key_data"]["encryption_context"]["mrtr:audiences"] = "billing,intruder"

    edit(store, widen)
    with pytest.raises(UnwrapError, match=rf"key {kid}: cannot unwrap: InvalidCiphertextException"):
        KMSEnvelopeCodec(store, audience="intruder")


def test_key_wrapped_under_a_second_kms_key_is_refused(kms: KMSEnv, tmp_path: Path) -> None:
    # The caller may use both KMS keys, but the ring names one; the KeyId check refuses the other.
    first, second = kms.create_key("first"), kms.create_key("second")
    store = make_ring(tmp_path, first, "ring.json")
    ring = store.load()
    other = make_ring(tmp_path, second, "other.json")

    # A blob wrapped under the second key, with this ring's kid and context, recorded as the second key.
    import boto3

    blob = boto3.client("kms").generate_data_key(
        KeyId=second, KeySpec="AES_256", EncryptionContext=ring.primary.key_data["encryption_context"]
    )["CiphertextBlob"]
    forged = {
        "ciphertext_blob": base64.b64encode(blob).decode(),
        "kms_key_arn": second,
        "encryption_context": dict(ring.primary.key_data["encryption_context"]),
    }
    edit(store, lambda doc: doc["keys"][0].update(key_data=forged))
    with pytest.raises(UnwrapError, match=rf"key {ring.primary.kid}: cannot unwrap: KeyIdMismatch"):
        KMSEnvelopeCodec(store, audience="svc")

    # Recorded as the first key (the forger edits the ARN too): Decrypt with KeyId=first is refused by KMS.
    edit(store, lambda doc: doc["keys"][0]["key_data"].update(kms_key_arn=first))
    with pytest.raises(
        UnwrapError, match=rf"key {ring.primary.kid}: cannot unwrap: (AccessDeniedException|IncorrectKeyException)"
    ):
        KMSEnvelopeCodec(store, audience="svc")

    # A whole ring under the second key, opened by a process pinned to the first: refused before any call.
    kms.proxy.reset()
    with pytest.raises(UnwrapError, match="KeyIdMismatch"):
        KMSEnvelopeCodec(other, audience="svc", kms_key_id=first)
    assert kms.proxy.count == 0


def test_kms_answering_with_another_key_id_is_refused(kms: KMSEnv, tmp_path: Path) -> None:
    # The returned KeyId is compared with the configured one even if the server ignored KeyId.
    first, second = kms.create_key("first"), kms.create_key("second")
    store = make_ring(tmp_path, first)
    kms.proxy.response_hook = lambda target, body: body.replace(first.encode(), second.encode())
    with pytest.raises(UnwrapError, match=r"cannot unwrap: KeyIdMismatch \(KMS decrypted it with"):
        KMSEnvelopeCodec(store, audience="svc")


def test_corrupted_blob_names_the_kid_and_the_kms_code(kms: KMSEnv, tmp_path: Path) -> None:
    store = make_ring(tmp_path, kms.create_key())
    kid = store.load().primary.kid

    def corrupt(doc: dict[str, Any]) -> None:
        blob = bytearray(base64.b64decode(doc["keys"][0]["key_data"]["ciphertext_blob"]))
        blob[-1] ^= 1
        doc["keys"][0]["key_data"]["ciphertext_blob"] = base64.b64encode(bytes(blob)).decode()

    edit(store, corrupt)
    with pytest.raises(UnwrapError) as info:
        KMSEnvelopeCodec(store, audience="svc")
    assert str(info.value).startswith(f"key {kid}: cannot unwrap: InvalidCiphertextException")


def test_plaintext_material_in_a_kms_ring_is_refused(kms: KMSEnv, tmp_path: Path) -> None:
    store = make_ring(tmp_path, kms.create_key())
    edit(store, lambda doc: doc["keys"][0].update(material=base64.b64encode(b"k" * 32).decode()))
    with pytest.raises(UnwrapError, match="PlaintextInRing"):
        KMSEnvelopeCodec(store, audience="svc")


def test_no_failure_message_contains_key_material(kms: KMSEnv, tmp_path: Path) -> None:
    store = make_ring(tmp_path, kms.create_key())
    blob = json.loads(store.path.read_text())["keys"][0]["key_data"]["ciphertext_blob"]
    edit(store, lambda doc: doc["keys"][0]["key_data"]["encryption_context"].update({"mrtr:kid": "ffffffff"}))
    with pytest.raises(UnwrapError) as info:
        KMSEnvelopeCodec(store, audience="svc")
    assert blob not in str(info.value) and blob[:16] not in str(info.value)


# --- audience scope and the encryption context ------------------------------------------------------


def test_context_follows_the_audience_scope(kms: KMSEnv, tmp_path: Path) -> None:
    # Decision (docs/kms.md): scope changes re-wrap every usable key, so IAM conditions see the current scope.
    store = make_ring(tmp_path, kms.create_key(), audiences=("billing",))
    old = KMSEnvelopeCodec(store, audience="billing")
    token = old.seal(b"in flight")
    kms.proxy.reset()
    scope.add(store, "search")
    assert kms.proxy.calls == {"ReEncrypt": 1}
    ring = store.load()
    assert ring.primary.key_data["encryption_context"]["mrtr:audiences"] == "billing,search"
    assert KMSEnvelopeCodec(store, audience="billing").unseal(token) == b"in flight"
    assert KMSEnvelopeCodec(store, audience="search").seal(b"x").startswith("mk2.")
    scope.remove(store, "search")
    assert store.load().primary.key_data["encryption_context"]["mrtr:audiences"] == "billing"
    with pytest.raises(AudienceError):
        KMSEnvelopeCodec(store, audience="search")


def test_reload_unwraps_only_new_keys(kms: KMSEnv, tmp_path: Path) -> None:
    store = make_ring(tmp_path, kms.create_key())
    codec = KMSEnvelopeCodec(store, audience="svc")
    run_step(store, "begin")
    kms.proxy.reset()
    assert codec.reload() is True
    assert kms.proxy.calls == {"Decrypt": 1}
    assert codec.reload() is False
    assert kms.proxy.calls == {"Decrypt": 1}


def test_open_codec_passes_timeouts_and_pin(kms: KMSEnv, tmp_path: Path) -> None:
    arn = kms.create_key()
    store = make_ring(tmp_path, arn)
    codec = open_codec(store, audience="svc", kms_key_id=arn, read_timeout=1.5, max_attempts=1)
    assert isinstance(codec, KMSEnvelopeCodec)
    config = codec._kms.client.meta.config
    assert (config.read_timeout, config.retries["total_max_attempts"]) == (1.5, 1)


# --- the key_data parser takes what a keystore holds: property-tested (our rule) ---------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=8,
)


@given(
    st.dictionaries(
        st.sampled_from(["ciphertext_blob", "kms_key_arn", "encryption_context", "other"]), _json, max_size=4
    )
)
def test_key_data_parser_accepts_or_raises_unwrap_error_only(data: dict[str, Any]) -> None:
    try:
        wrapped = WrappedKey.from_key_data("1a2b3c4d", data)
    except UnwrapError as exc:
        assert str(exc).startswith("key 1a2b3c4d: cannot unwrap: MalformedKeyData (")
    else:
        assert wrapped.to_key_data()["kms_key_arn"] == data["kms_key_arn"]
        assert wrapped.context == data["encryption_context"]


@given(st.binary(min_size=1, max_size=300), st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
def test_key_data_round_trips(blob: bytes, context: dict[str, str]) -> None:
    wrapped = WrappedKey(blob, "arn:aws:kms:us-east-1:111122223333:key/k", context)
    assert WrappedKey.from_key_data("1a2b3c4d", wrapped.to_key_data()) == wrapped


def test_from_ring_unwraps_a_ring_in_memory(kms: KMSEnv, tmp_path: Path) -> None:
    store = make_ring(tmp_path, kms.create_key())
    codec = KMSEnvelopeCodec.from_ring(store.load(), audience="svc")
    assert codec.unseal(codec.seal(b"in memory")) == b"in memory"
    assert codec.reload() is False
    assert kms.proxy.calls == {"DescribeKey": 1, "GenerateDataKey": 1, "Decrypt": 1}
