"""Bad tokens: every one is refused with the SDK's `InvalidRequestState`, and nothing else escapes.

Rules ("Decoding is strict: only the exact string that `seal` produced unseals; the
length is capped before decoding. Every failure raises the SDK's `InvalidRequestState`"), the
SDK's `RequestStateCodec` contract, and RFC 4648 section 5 (base64url, no padding).
Our rule: property tests for every parser of untrusted input.
"""

from __future__ import annotations

import base64
import itertools
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.changes.rotation import transition
from mrtr_keys.codecs.aesgcm import TOKEN_PREFIX
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.ring.model import KeyFormat
from mrtr_keys.token import MAX_TOKEN_CHARS, MalformedToken, b64u_decode, b64u_encode, pack, unpack
from tests.fixtures.keyrings import T0, fresh_ring

AUD = "billing"
PAYLOAD = b'{"v":1,"s":"step-2"}'
B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"

# One ring mid-rotation (phase 1): the primary seals, a second key verifies.
RING = transition("begin", fresh_ring(key_format=KeyFormat.MK1), T0 + timedelta(minutes=1), key_format="mk1").ring
CODEC = LocalAESGCMCodec.from_ring(RING, audience=AUD)
OTHER_KID = next(k.kid for k in RING.keys if k.kid != RING.primary.kid)


def rejected(token: object, codec: LocalAESGCMCodec = CODEC) -> str:
    """The reason code of the InvalidRequestState `unseal` raised (any other exception fails the test)."""
    with pytest.raises(InvalidRequestState) as info:
        codec.unseal(token)  # type: ignore[arg-type]
    return str(info.value)


def token_with(chars: str) -> str:
    """A token whose body contains every character in `chars` (reseals until it does)."""
    for i in itertools.count():
        token = CODEC.seal(PAYLOAD + str(i).encode())
        if all(c in token[len(TOKEN_PREFIX) :] for c in chars):
            return token
    raise AssertionError("unreachable")


def decoded(token: str) -> bytes:
    return b64u_decode(token[len(TOKEN_PREFIX) :])


def test_a_valid_token_unseals() -> None:
    """The control case: without it every rejection below would pass for a broken codec too."""
    assert CODEC.unseal(CODEC.seal(PAYLOAD)) == PAYLOAD


@pytest.mark.parametrize("junk", ["A", "AAAA", "x", ".", "=", "\x00", "é", "mk1."])
def test_junk_appended_is_rejected(junk: str) -> None:
    """Strict decoding: trailing characters, even ones that still decode, are not the token seal produced."""
    rejected(CODEC.seal(PAYLOAD) + junk)


@pytest.mark.parametrize("ws", [" ", "\n", "\r\n", "\t"])
@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_whitespace_inside_is_rejected(ws: str, where: str) -> None:
    """RFC 4648 section 3.3: a decoder must reject characters outside the alphabet; no whitespace skipping."""
    token = CODEC.seal(PAYLOAD)
    pos = {"start": len(TOKEN_PREFIX), "middle": len(token) // 2, "end": len(token)}[where]
    assert rejected(token[:pos] + ws + token[pos:]) == "malformed"


@pytest.mark.parametrize("padding", ["=", "==", "===", "===="])
def test_padding_added_is_rejected(padding: str) -> None:
    """RFC 4648 section 5 without padding: a padded spelling is a different string."""
    assert rejected(CODEC.seal(PAYLOAD) + padding) == "malformed"


@pytest.mark.parametrize(("ours", "theirs"), [("-", "+"), ("_", "/")])
def test_standard_alphabet_in_place_of_url_safe_is_rejected(ours: str, theirs: str) -> None:
    """base64url only: `+`/`/` (standard base64, RFC 4648 section 4) are refused even where they
    decode to the same bytes as `-`/`_`."""
    token = token_with(ours)
    i = token.index(ours, len(TOKEN_PREFIX))
    swapped = token[:i] + theirs + token[i + 1 :]
    std = swapped[len(TOKEN_PREFIX) :].replace("-", "+").replace("_", "/")
    assert base64.b64decode(std + "=" * (-len(std) % 4)) == decoded(token), "same bytes, other spelling"
    assert rejected(swapped) == "malformed"
    assert CODEC.unseal(token).startswith(PAYLOAD)


def test_kid_changed_to_another_ring_keys_kid_is_rejected() -> None:
    """The kid is associated data, and the kid picks the key (no trial decryption)."""
    raw = decoded(CODEC.seal(PAYLOAD))
    assert raw[:4].hex() == RING.primary.kid
    relabelled = TOKEN_PREFIX + b64u_encode(bytes.fromhex(OTHER_KID) + raw[4:])
    assert rejected(relabelled) == "seal"


def test_unknown_kid_is_rejected() -> None:
    raw = decoded(CODEC.seal(PAYLOAD))
    unknown = next(k for k in ("00000000", "ffffffff") if RING.lookup(k) is None)
    assert rejected(TOKEN_PREFIX + b64u_encode(bytes.fromhex(unknown) + raw[4:])) == "unknown kid"


def test_sealed_for_another_audience_is_rejected() -> None:
    """HKDF info and associated data carry the audience; same ring, other audience: refused."""
    token = LocalAESGCMCodec.from_ring(RING, audience="payments").seal(PAYLOAD)
    assert rejected(token) == "seal"


@pytest.mark.parametrize(
    "token",
    [
        "",
        TOKEN_PREFIX,
        "mk1",
        "v1.",
        "mk1.AAAA",
        pack(TOKEN_PREFIX, bytes.fromhex(RING.primary.kid), bytes(27)),  # one byte short of nonce + tag
        "x" * (MAX_TOKEN_CHARS + 1),
        TOKEN_PREFIX + "A" * MAX_TOKEN_CHARS,
    ],
    ids=["empty", "prefix-only", "no-dot", "sdk-prefix", "short", "short-by-one", "over-cap", "over-cap-after-prefix"],
)
def test_empty_short_and_huge_strings_are_rejected(token: str) -> None:
    """Lengths are checked before decoding: a string over the 4 MiB cap costs a length comparison, not a decode."""
    reason = rejected(token)
    assert reason == ("too long" if len(token) > MAX_TOKEN_CHARS else "malformed")


def test_sdk_token_is_rejected() -> None:
    """Our prefix differs from the SDK's ``v1.``: an SDK token under the same 32 bytes does not unseal."""
    from mcp.server.request_state import AESGCMRequestStateCodec

    assert RING.primary.material is not None
    sdk_token = AESGCMRequestStateCodec([RING.primary.material]).seal(PAYLOAD)
    assert sdk_token.startswith("v1.")
    rejected(sdk_token)
    rejected(TOKEN_PREFIX + sdk_token[3:])


def test_every_single_bit_flip_of_the_decoded_bytes_is_rejected() -> None:
    """Every bit of kid, nonce, ciphertext and tag is authenticated (AES-GCM, kid in the AAD)."""
    token = CODEC.seal(PAYLOAD)
    raw = decoded(token)
    for i in range(len(raw)):
        for bit in range(8):
            flipped = bytearray(raw)
            flipped[i] ^= 1 << bit
            rejected(TOKEN_PREFIX + b64u_encode(bytes(flipped)))
    assert CODEC.unseal(token) == PAYLOAD


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_random_strings_never_unseal(text: str) -> None:
    rejected(text)
    rejected(TOKEN_PREFIX + text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=B64URL, min_size=0, max_size=160))
def test_random_text_in_the_token_alphabet_never_unseals(body: str) -> None:
    """Random well-formed-looking bodies: decoded or not, they never authenticate."""
    rejected(TOKEN_PREFIX + body)
    rejected(TOKEN_PREFIX + RING.primary.kid + body)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(min_value=0))
def test_a_random_bit_flip_of_a_fresh_token_never_unseals(payload: bytes, where: int) -> None:
    token = CODEC.seal(payload)
    raw = bytearray(decoded(token))
    raw[where % len(raw)] ^= 1 << (where // len(raw) % 8)
    rejected(TOKEN_PREFIX + b64u_encode(bytes(raw)))
    assert CODEC.unseal(token) == payload


# The framing parser itself (mrtr_keys.token): strict inverse of the encoder.


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_base64url_round_trips_without_padding(data: bytes) -> None:
    text = b64u_encode(data)
    assert "=" not in text and set(text) <= set(B64URL)
    assert b64u_decode(text) == data


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=80) | st.text(alphabet=B64URL + "=+/ \n", max_size=80))
def test_base64url_decodes_only_its_own_canonical_spelling(text: str) -> None:
    """Decode, re-encode, compare (as the SDK's `_b64u_decode` does): anything accepted is canonical."""
    try:
        raw = b64u_decode(text)
    except MalformedToken:
        return
    assert b64u_encode(raw) == text


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=4, max_size=4), st.binary(max_size=100))
def test_pack_and_unpack_are_inverse(kid: bytes, body: bytes) -> None:
    assert unpack("mk1.", pack("mk1.", kid, body)) == (kid, body)


def test_unpack_refuses_short_wrong_prefix_and_over_long_tokens() -> None:
    token = pack("mk1.", b"\x01\x02\x03\x04", b"\x00" * 28)
    assert unpack("mk1.", token, min_body=28)[0] == b"\x01\x02\x03\x04"
    for bad, kwargs in [(token, {"min_body": 29}), ("v1." + token[4:], {}), ("mk1." + "A" * MAX_TOKEN_CHARS, {})]:
        with pytest.raises(MalformedToken):
            unpack("mk1.", bad, **kwargs)  # type: ignore[arg-type]
