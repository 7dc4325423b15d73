"""`LocalAESGCMCodec` (deliverable 4): the local codec over a file key ring.

The generic codec contract runs in test_contract.py; this module pins what is specific to the
local codec: the documented byte layout (docs/token-format.md, re-implemented here from the
spec with `cryptography` directly), how it is opened, `reload()`, limits and the SDK entry point.
"""

from __future__ import annotations

import base64
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESGCMSIV
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from mcp.server.mcpserver import InvalidRequestState, RequestStateSecurity

import mrtr_keys
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs import LocalAESGCMCodec
from mrtr_keys.codecs.aesgcm import MAX_PAYLOAD_BYTES
from mrtr_keys.errors import ConfigError, KeyRingError, MrtrKeysError
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.token import MAX_TOKEN_CHARS
from tests.fixtures.keyrings import fresh_ring, write_ring_doc

AUD = "billing"


SPEC = {
    "mk1": (AESGCM, b"mrtr-keys/v1/aes-256-gcm/audience:"),
    "mk2": (AESGCMSIV, b"mrtr-keys/v2/aes-256-gcm-siv/audience:"),
}
"""docs/token-format.md: each format's AEAD (from `cryptography`) and HKDF info prefix."""


def spec_key(fmt: str, ring_key: bytes, audience: str) -> AESGCM | AESGCMSIV:
    aead, info = SPEC[fmt]
    return aead(HKDF(algorithm=SHA256(), length=32, salt=None, info=info + audience.encode()).derive(ring_key))


def spec_open(token: str, ring_key: bytes, audience: str) -> tuple[str, bytes]:
    """docs/token-format.md, independently: returns (kid hex, plaintext)."""
    fmt, dot, body = token.partition(".")
    assert dot and fmt in SPEC
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    kid, nonce, sealed = raw[:4], raw[4:16], raw[16:]
    return kid.hex(), spec_key(fmt, ring_key, audience).decrypt(
        nonce, sealed, f"{fmt}.".encode() + kid + audience.encode()
    )


def spec_seal(
    payload: bytes, kid: str, ring_key: bytes, audience: str, fmt: str = "mk2", nonce: bytes | None = None
) -> str:
    nonce = os.urandom(12) if nonce is None else nonce
    raw_kid = bytes.fromhex(kid)
    sealed = spec_key(fmt, ring_key, audience).encrypt(nonce, payload, f"{fmt}.".encode() + raw_kid + audience.encode())
    return f"{fmt}." + base64.urlsafe_b64encode(raw_kid + nonce + sealed).decode().rstrip("=")


@pytest.mark.parametrize("fmt", ["mk2", "mk1"])
@pytest.mark.parametrize("audience", ["billing", "sërvice-ü", "a"])
def test_tokens_follow_the_documented_format(tmp_path: Path, fmt: str, audience: str) -> None:
    """New rings seal mk2 (AES-256-GCM-SIV); a ring made with --key-format mk1 (or before 0.2.0) seals mk1."""
    keystore = FileKeystore(tmp_path / "keyring.json")
    create_ring(keystore, key_format=fmt)
    ring = keystore.load()
    assert ring.primary.material is not None and ring.primary.format.value == fmt
    codec = LocalAESGCMCodec(keystore, audience=audience)
    token = codec.seal(b"payload")
    assert token.startswith(f"{fmt}.")
    assert spec_open(token, ring.primary.material, audience) == (ring.primary.kid, b"payload")
    assert len(base64.urlsafe_b64decode(token[4:] + "==")) == 4 + 12 + len(b"payload") + 16
    assert codec.unseal(spec_seal(b"from the spec", ring.primary.kid, ring.primary.material, audience, fmt)) == (
        b"from the spec"
    )
    other = "mk1" if fmt == "mk2" else "mk2"  # the same body under the other prefix: refused, never opened
    with pytest.raises(InvalidRequestState, match="other format"):
        codec.unseal(other + token[3:])


def test_opened_from_a_path_a_string_a_file_url_or_a_keystore(keystore: FileKeystore) -> None:
    token = LocalAESGCMCodec(keystore, audience=AUD).seal(b"x")
    for where in (keystore.path, str(keystore.path), keystore.url, keystore):
        assert LocalAESGCMCodec(where, audience=AUD).unseal(token) == b"x"


def test_reload_switches_to_a_new_generation(keystore: FileKeystore) -> None:
    """A codec works on the ring as loaded; `reload()` re-reads the keystore."""
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    assert codec.reload() is False
    run_step(keystore, "begin")
    run_step(keystore, "promote")
    new_token = LocalAESGCMCodec(keystore, audience=AUD).seal(b"new")
    with pytest.raises(InvalidRequestState):
        codec.unseal(new_token)
    assert codec.reload() is True and codec.generation == 3
    assert codec.unseal(new_token) == b"new"
    assert codec.seal(b"x") != new_token and codec.unseal(codec.seal(b"x")) == b"x"


def test_reload_of_a_broken_ring_raises_and_keeps_the_loaded_one(keystore: FileKeystore) -> None:
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    token = codec.seal(b"kept")
    write_ring_doc(keystore.path, "{broken")
    with pytest.raises(KeyRingError):
        codec.reload()
    assert codec.unseal(token) == b"kept"


def test_a_ring_made_for_another_codec_is_refused(tmp_path: Path) -> None:
    doc = fresh_ring().to_json()
    doc["codec"] = {"type": "kms", "kms_key_id": "arn:aws:kms:eu-west-1:111122223333:key/x"}
    path = write_ring_doc(tmp_path / "ring.json", doc)
    with pytest.raises(ConfigError, match="'kms' codec"):
        LocalAESGCMCodec(path, audience=AUD)


def test_the_largest_payload_round_trips_and_one_more_byte_is_refused_at_seal(keystore: FileKeystore) -> None:
    """Every token seal returns is one unseal accepts: the payload limit keeps tokens within MAX_TOKEN_CHARS."""
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    token = codec.seal(b"\xff" * MAX_PAYLOAD_BYTES)
    assert len(token) == MAX_TOKEN_CHARS
    assert codec.unseal(token) == b"\xff" * MAX_PAYLOAD_BYTES
    with pytest.raises(MrtrKeysError, match=f"over the {MAX_PAYLOAD_BYTES}-byte"):
        codec.seal(b"\xff" * (MAX_PAYLOAD_BYTES + 1))


def test_seal_is_safe_from_many_threads(keystore: FileKeystore) -> None:
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    tokens: list[str] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        mine = [codec.seal(f"{i}-{j}".encode()) for j in range(200)]
        with lock:
            tokens.extend(mine)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    nonces = {base64.urlsafe_b64decode(t[4:] + "==")[4:16] for t in tokens}
    assert len(tokens) == len(nonces) == 800


def test_a_forked_child_never_reuses_the_parents_nonces(keystore: FileKeystore) -> None:
    """NIST SP 800-38D 8.2.2: a nonce never repeats under one key; nonces are fetched in blocks, so a
    fork must not leave parent and child drawing from the same block."""
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    codec.seal(b"prime the nonce block")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.write(write, codec.seal(b"child").encode())
        finally:
            os._exit(0)
    os.close(write)
    parent_token = codec.seal(b"parent")
    with os.fdopen(read) as f:
        child_token = f.read()
    os.waitpid(pid, 0)

    def nonce(t: str) -> bytes:
        return base64.urlsafe_b64decode(t[4:] + "==")[4:16]

    assert codec.unseal(child_token) == b"child"
    assert nonce(child_token) != nonce(parent_token)


def test_request_state_security_returns_a_ready_sdk_policy(keystore: FileKeystore) -> None:
    """`request_state_security(keystore, audience=..., ttl=600.0)`."""
    security = mrtr_keys.request_state_security(keystore.url, audience=AUD, ttl=300)
    assert isinstance(security, RequestStateSecurity)
    assert security.audience == AUD and security.ttl == 300.0
    assert isinstance(security.codec, LocalAESGCMCodec)
    assert security.codec.unseal(security.codec.seal(b"x")) == b"x"


@pytest.mark.parametrize("ttl", [601, 0, -5, float("nan"), float("inf")])
def test_request_state_security_refuses_a_ttl_the_rotation_gate_cannot_cover(
    keystore: FileKeystore, ttl: float
) -> None:
    """A TTL longer than the ring's would let `retire` (promote + ring TTL + 60 s) reject live rounds."""
    with pytest.raises(ConfigError):
        mrtr_keys.request_state_security(keystore.path, audience=AUD, ttl=ttl)


def test_the_observer_sees_kids_and_reasons_never_payloads(keystore: FileKeystore) -> None:
    events: list[tuple[str, ...]] = []

    class Recorder:
        def sealed(self, kid: str, token: str) -> None:
            events.append(("sealed", kid))

        def unsealed(self, kid: str, token: str) -> None:
            events.append(("unsealed", kid))

        def rejected(self, kid: str | None, token: str, reason: str) -> None:
            events.append(("rejected", str(kid), reason))

        def ring_loaded(self, generation: int, kid: str | None = None) -> None:
            events.append(("ring-loaded", str(kid), str(generation)))

    codec = LocalAESGCMCodec(keystore, audience=AUD, observer=Recorder())
    kid = keystore.load().primary.kid
    token = codec.seal(b"secret payload")
    codec.unseal(token)
    for bad in (token + "=", "mk1." + "A" * 60):
        with pytest.raises(InvalidRequestState):
            codec.unseal(bad)
    assert events == [
        ("ring-loaded", kid, "1"),
        ("sealed", kid),
        ("unsealed", kid),
        ("rejected", "None", "malformed"),
        ("rejected", "00000000", "unknown kid"),
    ]


def test_the_documented_test_vector_unseals() -> None:
    """docs/token-format.md, "Test vector": ring key 00..1f, kid 0a0b0c0d, audience billing, nonce 00..0b."""
    from datetime import UTC, datetime

    from mrtr_keys.ring.model import Key, KeyRing, KeyState

    key = Key(
        kid="0a0b0c0d", state=KeyState.PRIMARY, created_at=datetime(2026, 1, 1, tzinfo=UTC), material=bytes(range(32))
    )
    codec = LocalAESGCMCodec.from_ring(KeyRing(ring_id="r-test", generation=1, keys=(key,)), audience="billing")
    assert codec.unseal("mk1.CgsMDQABAgMEBQYHCAkKCznrA19r5lkhee3gAwE1yZOwWO5a0g") == b"hello"
    with pytest.raises(InvalidRequestState):
        LocalAESGCMCodec.from_ring(KeyRing(ring_id="r-test", generation=1, keys=(key,)), audience="Billing").unseal(
            "mk1.CgsMDQABAgMEBQYHCAkKCznrA19r5lkhee3gAwE1yZOwWO5a0g"
        )


MK2_VECTOR = "mk2.CgsMDQABAgMEBQYHCAkKC6Uh7ZpEKE0dTpOl8hflJYoQbGCy3g"


def test_the_documented_mk2_test_vector_unseals_and_is_what_the_spec_seals() -> None:
    """docs/token-format.md, "Test vector (mk2)": the same inputs as mk1's under AES-256-GCM-SIV (RFC 8452)."""
    from datetime import UTC, datetime

    from mrtr_keys.ring.model import Key, KeyFormat, KeyRing, KeyState

    key = Key(
        kid="0a0b0c0d",
        state=KeyState.PRIMARY,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        material=bytes(range(32)),
        format=KeyFormat.MK2,
    )
    ring = KeyRing(ring_id="r-test", generation=1, keys=(key,))
    assert spec_seal(b"hello", "0a0b0c0d", bytes(range(32)), "billing", "mk2", bytes(range(12))) == MK2_VECTOR
    assert LocalAESGCMCodec.from_ring(ring, audience="billing").unseal(MK2_VECTOR) == b"hello"
    with pytest.raises(InvalidRequestState):
        LocalAESGCMCodec.from_ring(ring, audience="Billing").unseal(MK2_VECTOR)
    mk1 = KeyRing(ring_id="r-test", generation=1, keys=(replace(key, format=KeyFormat.MK1),))
    with pytest.raises(InvalidRequestState, match="other format"):  # an mk2 token never opens under an mk1 key
        LocalAESGCMCodec.from_ring(mk1, audience="billing").unseal(MK2_VECTOR)


def test_mk2_is_rfc_8452_aes_256_gcm_siv() -> None:
    """The primitive under mk2 is RFC 8452's AEAD_AES_256_GCM_SIV: its appendix C.2 vectors, through
    `cryptography` (the one AEAD we call, never our own)."""
    key, nonce = bytes.fromhex("01" + "00" * 31), bytes.fromhex("03" + "00" * 11)
    assert AESGCMSIV(key).encrypt(nonce, b"", b"").hex() == "07f5f4169bbf55a8400cd47ea6fd400f"
    assert AESGCMSIV(key).encrypt(nonce, bytes.fromhex("0100000000000000"), b"").hex() == (
        "c2ef328e5c71c83b843122130f7364b761e0b97427e3df28"
    )
