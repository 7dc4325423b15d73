"""The token wire format shared by every codec: prefix, kid, body, strict base64url.

A token is ``PREFIX + base64url(kid || body)``, unpadded (RFC 4648 section 5,
no ``=``), where ``kid`` is the 4 raw bytes of the key id (shown as 8 lowercase
hex characters) and ``body`` is codec-specific (for the AES-GCM core: a 12-byte
nonce then ciphertext and the 16-byte tag). The prefix is the format version; it
ends in ``.`` like the MCP SDK's ``v1.`` and never equals it.

Parsing is strict: a body decodes only if re-encoding it gives back the exact
text, so padding, whitespace, ``+``/``/`` or any other spelling of the same bytes
is refused; lengths are capped before any decoding. This module holds no keys.
See docs/token-format.md.
"""

from __future__ import annotations

import binascii
import re

import pybase64

KID_BYTES = 4
"""Raw length of a kid inside a token (bytes)."""

KID_PATTERN = re.compile(r"[0-9a-f]{8}")
"""A kid as people and the key ring spell it: 8 lowercase hex characters."""

MAX_TOKEN_CHARS = 4 * 1024 * 1024
"""Longest token any codec accepts (characters, 4 MiB); checked before decoding.

The MCP SDK's contract is that a codec round-trips any payload; the largest ``requestState`` that can
reach a server is bounded by the request body its streamable HTTP transport accepts,
``mcp.server.transport_security.DEFAULT_MAX_REQUEST_BODY_SIZE`` (4 MiB in mcp 2.3). A token is ASCII, so
one character is one byte of that body: no token the SDK can deliver is refused for its length. The one
cap every codec, the sidecar's payload limit and its default body limit derive from."""

_B64_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
_PAD = ("", "", "==", "=")
# Canonical last characters by ``len(text) % 4``: the unused low bits of the last
# sextet must be zero (RFC 4648 section 3.5), 4 bits when 2 characters remain, 2 when 3 do.
_CANONICAL_LAST: tuple[frozenset[str], ...] = (
    frozenset(),
    frozenset(),
    frozenset(c for i, c in enumerate(_B64_ALPHABET) if i & 0x0F == 0),
    frozenset(c for i, c in enumerate(_B64_ALPHABET) if i & 0x03 == 0),
)


class MalformedToken(ValueError):
    """The text is not a token of this format. The message is a short reason code."""


def b64u_encode(data: bytes) -> str:
    """Unpadded base64url (RFC 4648 section 5) of `data` (SIMD base64 from `pybase64`)."""
    return pybase64.b64encode(data, altchars=b"-_").rstrip(b"=").decode("ascii")


def b64u_decode(text: str) -> bytes:
    """Strict inverse of `b64u_encode`: only the canonical unpadded base64url of some bytes decodes.

    Refused: padding, whitespace or any other character outside the URL-safe alphabet
    (``+`` and ``/`` included), a length of 1 mod 4, and non-zero unused trailing bits
    (RFC 4648 section 3.5), so each byte string has exactly one accepted spelling.

    Raises:
        MalformedToken: `text` is not the canonical unpadded base64url of any bytes.
    """
    rem = len(text) & 3
    # pybase64 with altchars also takes the standard alphabet's "+" and "/": refuse them here.
    if rem == 1 or "=" in text or "+" in text or "/" in text or (rem and text[-1] not in _CANONICAL_LAST[rem]):
        raise MalformedToken("malformed")
    try:
        # validate=True refuses every other character (whitespace, NUL); non-ASCII text is a ValueError.
        return pybase64.b64decode(text + _PAD[rem], altchars=b"-_", validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise MalformedToken("malformed") from None


def kid_to_bytes(kid: str) -> bytes:
    """The 4 raw bytes of an 8-hex-character kid. Raises `ValueError` for anything else."""
    if KID_PATTERN.fullmatch(kid) is None:
        raise ValueError("a kid is 8 lowercase hex characters")
    return bytes.fromhex(kid)


def pack(prefix: str, kid: bytes, body: bytes) -> str:
    """Build ``prefix + b64u(kid || body)``; `kid` must be `KID_BYTES` long."""
    if len(kid) != KID_BYTES:
        raise ValueError(f"kid must be {KID_BYTES} bytes")
    return prefix + b64u_encode(kid + body)


def unpack(prefix: str, token: str, *, min_body: int = 0) -> tuple[bytes, bytes]:
    """Split a token into (raw kid, body) without verifying anything cryptographic.

    Raises:
        MalformedToken: wrong prefix, over `MAX_TOKEN_CHARS`, non-canonical base64url,
            or shorter than a kid plus `min_body` bytes. The message is a reason code
            (``too long`` or ``malformed``).
    """
    if not isinstance(token, str):
        raise MalformedToken("malformed")
    if len(token) > MAX_TOKEN_CHARS:
        raise MalformedToken("too long")
    if not token.startswith(prefix):
        raise MalformedToken("malformed")
    raw = b64u_decode(token[len(prefix) :])
    if len(raw) < KID_BYTES + min_body:
        raise MalformedToken("malformed")
    return raw[:KID_BYTES], raw[KID_BYTES:]


def decoded_bytes(token: str) -> bytes | None:
    """The decoded bytes of any ``PREFIX.BODY`` token (for fingerprints and inspection), or None.

    The prefix is kept as text before the first ``.``; the result is
    ``prefix_bytes + b"." + decoded_body`` so two spellings of one token cannot differ.
    """
    if len(token) > MAX_TOKEN_CHARS:
        return None
    head, dot, body = token.partition(".")
    if not dot or not head.isascii() or not head.isalnum():
        return None
    try:
        return head.encode("ascii") + b"." + b64u_decode(body)
    except MalformedToken:
        return None
