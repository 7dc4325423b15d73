"""Token inspection (`mrtr-keys inspect`): what a token says, with or without decrypting it.

Without a key nothing is decrypted: the format, kid, that kid's state in the
ring and the sizes come from the token's framing. With ``decrypt=True`` the
token is unsealed for an audience and the MCP SDK's envelope claims are read
(``v``, ``iat``, ``exp``, ``m``, ``t``, ``a``, ``aud``, ``p``, ``s``; see the SDK's
`request_state.py`). The inner state ``s`` is returned only when asked, as
``inner_state`` (``state`` is the kid's state in the ring).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from mrtr_keys.backends import backend_for
from mrtr_keys.errors import ConfigError, MrtrKeysError
from mrtr_keys.keystores import Keystore
from mrtr_keys.token import MalformedToken


class UninspectableToken(MrtrKeysError):
    """The text does not parse as a token of the ring's format, or does not verify (exit 1)."""


def inspect_token(
    keystore: Keystore,
    token: str,
    *,
    decrypt: bool = False,
    audience: str | None = None,
    show_state: bool = False,
    now: datetime | None = None,
) -> dict[str, Any]:
    """Describe `token`; see the module docstring for the fields.

    Raises:
        UninspectableToken: it does not parse, or (with `decrypt`) does not unseal.
        ConfigError: `decrypt` without an audience.
    """

    ring = keystore.load()
    backend = backend_for(ring.codec)
    try:
        info = backend.describe_token(ring, token)
    except MalformedToken as exc:
        raise UninspectableToken(f"not a valid token: it does not parse ({exc})") from None
    if info is None:
        raise UninspectableToken("not a valid token: unknown format prefix for this key ring")
    if not decrypt:
        return info
    if not audience:
        raise ConfigError("--decrypt needs --audience NAME (the audience the token was sealed for)")
    codec = backend.open_codec(keystore, audience=audience)
    try:
        payload = codec.unseal(token)
    except Exception as exc:
        # Imported only on failure: importing the `mcp` package costs ~1.5 s of CLI start-up.
        from mcp.server.mcpserver import InvalidRequestState

        if isinstance(exc, InvalidRequestState):
            raise UninspectableToken(f"token does not unseal for audience {audience!r} ({exc})") from None
        raise
    info["decrypted"] = True
    info.update(_envelope(payload, show_state=show_state, now=now or datetime.now(UTC)))
    return info


def _envelope(payload: bytes, *, show_state: bool, now: datetime) -> dict[str, Any]:
    try:
        claims = json.loads(payload)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes: not an envelope
        return {"envelope": "not an MCP SDK envelope", "payload_bytes": len(payload)}
    if not isinstance(claims, dict):
        return {"envelope": "not an MCP SDK envelope", "payload_bytes": len(payload)}
    iat, exp = claims.get("iat"), claims.get("exp")
    out: dict[str, Any] = {
        "envelope_version": claims.get("v"),
        "method": claims.get("m"),
        "target": claims.get("t"),
        "audience": claims.get("aud"),
        "issued_at": _time(iat),
        "expires_at": _time(exp),
        "expired": (not isinstance(exp, int | float)) or not (now.timestamp() < exp),
        "principal_bound": "p" in claims,
        "payload_bytes": len(payload),
    }
    if show_state:  # not "state": that field is the kid's state in the ring
        out["inner_state"] = claims.get("s")
    return out


def _time(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return datetime.fromtimestamp(value, UTC).isoformat().replace("+00:00", "Z")
    except (OverflowError, ValueError, OSError):
        return None
