"""What `mrtr-keys inspect` can say about a token without decrypting it."""

from __future__ import annotations

from typing import Any

from mrtr_keys.codecs.aesgcm import NONCE_BYTES, TAG_BYTES, TOKEN_PREFIX
from mrtr_keys.keyring import KeyRing
from mrtr_keys.token import MalformedToken, unpack


def describe_aesgcm_token(ring: KeyRing | None, token: str) -> dict[str, Any]:
    """Format version, kid, the kid's state in `ring`, and sizes (bytes) of an ``mk1.`` token.

    Raises:
        MalformedToken: the text does not parse as an ``mk1.`` token.
    """
    raw_kid, body = unpack(TOKEN_PREFIX, token, min_body=NONCE_BYTES + TAG_BYTES)
    kid = raw_kid.hex()
    key = ring.lookup(kid) if ring is not None else None
    return {
        "format": TOKEN_PREFIX.rstrip("."),
        "kid": kid,
        "state": key.state.value if key is not None else "unknown",
        "token_chars": len(token),
        "nonce_bytes": NONCE_BYTES,
        "ciphertext_bytes": len(body) - NONCE_BYTES - TAG_BYTES,
        "tag_bytes": TAG_BYTES,
    }


__all__ = ["MalformedToken", "describe_aesgcm_token"]
