"""The codec contract, run against every codec this project ships.

The contract is the MCP SDK's `RequestStateCodec` docstring (mcp/server/request_state.py):
`unseal(seal(p)) == p`, and `unseal` raises `InvalidRequestState` for any token it did not
mint unmodified, and nothing else. Our additions: tokens carry a
version prefix and a kid bound under the tag, decoding is strict, and no plaintext or key
material reaches a log line, an exception message or a repr.

Adding a codec = one entry in `CODEC_FACTORIES`: (name, name of a fixture returning a
`tests.fixtures.codec_contract.CodecUnderTest`).
"""

from __future__ import annotations

import base64
import logging

import pytest
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.token import MAX_TOKEN_CHARS
from tests.fixtures.codec_contract import CodecUnderTest

CODEC_FACTORIES: list[tuple[str, str]] = [
    ("local", "local_codec_factory"),
    ("local-mk1", "local_mk1_codec_factory"),
    ("kms", "kms_codec_factory"),
    ("sidecar", "sidecar_codec_factory"),
    ("vault-remote", "vault_remote_codec_factory"),
    ("vault-datakey", "vault_datakey_codec_factory"),
    # Rings adopted from the MCP SDK's keys=[KEY]: the SDK key seals the SDK's own v1. tokens.
    ("local-sdk", "sdk_codec_factory"),
    ("sidecar-sdk", "sidecar_sdk_codec_factory"),
]

SENTINEL = b'{"s":"SENTINEL-plaintext-7f3a9c"}'
AUD = "contract-audience"
B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


@pytest.fixture(params=[name for name, _ in CODEC_FACTORIES])
def codec_factory(request: pytest.FixtureRequest) -> CodecUnderTest:
    fixture_name = dict(CODEC_FACTORIES)[request.param]
    factory: CodecUnderTest = request.getfixturevalue(fixture_name)
    return factory


def _decode(cut: CodecUnderTest, token: str) -> bytearray:
    assert token.startswith(cut.prefix)
    body = token[len(cut.prefix) :]
    return bytearray(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


def _encode(cut: CodecUnderTest, raw: bytes) -> str:
    return cut.prefix + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _rejects(codec: object, token: object) -> InvalidRequestState:
    """Unseal must raise InvalidRequestState (pytest.raises would let any other exception fail the test too)."""
    with pytest.raises(InvalidRequestState) as info:
        codec.unseal(token)  # type: ignore[attr-defined]
    return info.value


@pytest.mark.parametrize("payload", [b"", b"\xfb\xef\xff", SENTINEL, bytes(range(256)) * 4, bytes(range(256)) * 256])
def test_round_trip(codec_factory: CodecUnderTest, payload: bytes) -> None:
    """SDK contract: unseal(seal(p)) == p, for an empty payload and bytes that are not UTF-8 too, and for the
    SDK's own codec tests' 64 KiB payload (the token cap follows the SDK's HTTP body limit)."""
    codec = codec_factory.make(AUD)
    token = codec.seal(payload)
    assert codec.unseal(token) == payload
    assert token.startswith(codec_factory.prefix)


def test_a_peer_loaded_from_the_same_ring_unseals(codec_factory: CodecUnderTest) -> None:
    """A fleet shares one ring; a token sealed by one instance unseals on another."""
    token = codec_factory.make(AUD).seal(SENTINEL)
    assert codec_factory.make(AUD).unseal(token) == SENTINEL


def test_tokens_are_url_safe_and_never_repeat(codec_factory: CodecUnderTest) -> None:
    """SDK contract: `seal` returns an opaque URL-safe token; a fresh nonce per token."""
    codec = codec_factory.make(AUD)
    tokens = {codec.seal(SENTINEL) for _ in range(50)}
    assert len(tokens) == 50
    for t in tokens:
        assert set(t[len(codec_factory.prefix) :]) <= set(B64URL)


@pytest.mark.parametrize("region", ["kid", "nonce", "ciphertext", "tag"])
def test_tampering_in_each_region_is_rejected(codec_factory: CodecUnderTest, region: str) -> None:
    """SDK contract: anything not minted unmodified is InvalidRequestState; every byte of every region
    of the token is under the tag (or picks the key)."""
    codec = codec_factory.make(AUD)
    token = codec.seal(SENTINEL)
    raw = _decode(codec_factory, token)
    start, stop, _ = codec_factory.regions[region].indices(len(raw))
    assert stop > start, f"region {region} is empty"
    for i in range(start, stop):
        for bit in (0x01, 0x80):
            tampered = bytearray(raw)
            tampered[i] ^= bit
            _rejects(codec, _encode(codec_factory, bytes(tampered)))
    assert codec.unseal(token) == SENTINEL


def test_tampered_prefix_is_rejected(codec_factory: CodecUnderTest) -> None:
    """The prefix is the format version (RFC 8725: never let a token pick its algorithm); any other
    prefix, including the SDK's own ``v1.``, is refused."""
    codec = codec_factory.make(AUD)
    token = codec.seal(SENTINEL)
    body = token[len(codec_factory.prefix) :]
    p = codec_factory.prefix
    for prefix in ("v1.", p.upper(), p[:-1] + "2.", p[:-1], p + ".", "", " " + p, p[:-1] + ":"):
        if prefix != p:
            _rejects(codec, prefix + body)


def test_kid_of_the_other_ring_key_is_rejected(codec_factory: CodecUnderTest) -> None:
    """The kid picks the key (never trial decryption) and is associated data: relabelling a token
    with the other usable key's kid does not unseal."""
    codec = codec_factory.make(AUD)
    raw = _decode(codec_factory, codec.seal(SENTINEL))
    kid = codec_factory.regions["kid"]
    assert bytes(raw[kid]) != codec_factory.other_kid
    raw[kid] = codec_factory.other_kid
    _rejects(codec, _encode(codec_factory, bytes(raw)))


def test_token_from_a_foreign_ring_is_rejected(codec_factory: CodecUnderTest) -> None:
    """A token minted under another ring (a foreign kid) never unseals, in either direction."""
    ours, theirs = codec_factory.make(AUD), codec_factory.make_foreign(AUD)
    exc = _rejects(ours, theirs.seal(SENTINEL))
    assert "kid" in str(exc) or codec_factory.name.startswith("sidecar")  # the sidecar never says why
    _rejects(theirs, ours.seal(SENTINEL))


def test_token_for_another_audience_is_rejected(codec_factory: CodecUnderTest) -> None:
    """Per-audience keys; a token sealed for A never unseals for B under the same ring."""
    token = codec_factory.make("a").seal(SENTINEL)
    _rejects(codec_factory.make("b"), token)
    assert codec_factory.make("a").unseal(token) == SENTINEL


def test_non_canonical_body_is_rejected(codec_factory: CodecUnderTest) -> None:
    """Strict decoding: only the exact string seal produced unseals; another spelling of the
    same bytes (non-zero trailing bits, padding, standard-alphabet characters) is refused."""
    codec = codec_factory.make(AUD)
    for payload in (b"x", b"xy", b"xyz"):  # cover all three lengths mod 3
        token = codec.seal(payload)
        body = token[len(codec_factory.prefix) :]
        spellings = [token + "=" * (-len(body) % 4 or 4), token + "\n", " " + token]
        if len(body) % 4:  # the last character has unused low bits: flipping one respells the same bytes
            respelled = token[:-1] + B64URL[B64URL.index(body[-1]) ^ 1]
            assert _decode(codec_factory, respelled) == _decode(codec_factory, token)
            spellings.append(respelled)
        for spelling in spellings:
            _rejects(codec, spelling)
        assert codec.unseal(token) == payload


def test_over_length_tokens_are_rejected_before_decoding(codec_factory: CodecUnderTest) -> None:
    """The length is capped before decoding (MAX_TOKEN_CHARS); the reason code says so."""
    codec = codec_factory.make(AUD)
    token = codec.seal(SENTINEL)
    exc = _rejects(codec, token + "A" * (MAX_TOKEN_CHARS + 1 - len(token)))
    assert str(exc) == "too long"
    _rejects(codec, codec_factory.prefix + "A" * (1 << 20))


@pytest.mark.parametrize("token", [None, b"mk1.AAAA", 12, ["mk1."]])
def test_a_non_string_is_rejected_with_invalid_request_state(codec_factory: CodecUnderTest, token: object) -> None:
    """SDK contract: nothing but InvalidRequestState escapes unseal, whatever a caller passes."""
    _rejects(codec_factory.make(AUD), token)


def test_no_plaintext_or_key_material_in_logs_errors_or_repr(
    codec_factory: CodecUnderTest, caplog: pytest.LogCaptureFixture
) -> None:
    """Our rule: no secret in a log line, an exception message or a repr()."""
    caplog.set_level(logging.DEBUG)
    codec = codec_factory.make(AUD)
    token = codec.seal(SENTINEL)
    codec.unseal(token)
    raw = _decode(codec_factory, token)
    raw[-1] ^= 1
    errors = [_rejects(codec, _encode(codec_factory, bytes(raw)))]
    errors.append(_rejects(codec_factory.make("other"), token))
    errors.append(_rejects(codec, token + "x"))
    text = caplog.text + "".join(f"{e!s}{e!r}" for e in errors) + repr(codec)
    assert "SENTINEL" not in text
    for secret in codec_factory.secrets:
        assert secret not in text
