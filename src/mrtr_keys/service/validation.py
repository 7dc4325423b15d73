"""The one validation of sidecar request bodies, for the fast ASGI path and the FastAPI routes alike.

Bodies are parsed with orjson (strict JSON, RFC 8259: no NaN or Infinity); a document orjson refuses
only because a string holds a lone surrogate escape (``"\\ud800"``, valid JSON grammar) is parsed again
by the standard library, so such a token reaches the codec and gets the one 400 every bad token gets.
Fields are checked by hand (microseconds a request); `mrtr_keys.service.schemas` holds the same rules as
pydantic models for the OpenAPI document, and tests/service/test_parity.py checks that the two accept
and refuse the same bodies.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from mrtr_keys.changes.scope import MAX_AUDIENCE_CHARS
from mrtr_keys.codecs.aesgcm import MAX_PAYLOAD_BYTES
from mrtr_keys.service.clients import Client
from mrtr_keys.service.outcomes import Loc, Outcome, forbidden, invalid
from mrtr_keys.token import MalformedToken, b64u_decode

MAX_PAYLOAD_B64_CHARS = (MAX_PAYLOAD_BYTES * 4 + 2) // 3
"""Longest ``payload`` text (unpadded base64url of `MAX_PAYLOAD_BYTES` bytes: the largest payload whose token
fits the one token cap, `mrtr_keys.token.MAX_TOKEN_CHARS`)."""

AUDIENCE_MSG = f"required: a string of 1-{MAX_AUDIENCE_CHARS} Unicode characters"
PAYLOAD_TYPE_MSG = "required: unpadded base64url text"
PAYLOAD_SIZE_MSG = f"longer than {MAX_PAYLOAD_BYTES} bytes"
PAYLOAD_B64_MSG = "not unpadded base64url (RFC 4648 section 5)"
TOKEN_TYPE_MSG = "required: a token string"  # noqa: S105 - a message, not a secret
EXTRA_MSG = "extra field not permitted"
OBJECT_MSG = "must be a JSON object"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_object(body: bytes) -> dict[str, Any] | Outcome:
    """The JSON object in `body`, or the 422 outcome (not JSON, or JSON but not an object)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        try:  # orjson refuses lone surrogates; the stdlib keeps them (and refuses NaN / Infinity here)
            doc = json.loads(body, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return invalid(("body",), "not a JSON document")
    if not isinstance(doc, dict):
        return invalid(("body",), OBJECT_MSG)
    return doc


def _text(value: str) -> bool:
    """True unless `value` holds a lone surrogate (not Unicode text: it has no UTF-8 form)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def fields(item: object, loc: Loc, second: str) -> tuple[str, str] | Outcome:
    """(audience, `second`) of an item ``{audience, payload}`` or ``{audience, token}``, or the 422."""
    if not isinstance(item, dict):
        return invalid(loc, OBJECT_MSG)
    if len(item) != 2 or "audience" not in item or second not in item:
        for name in sorted(item):
            if name not in ("audience", second):
                return invalid((*loc, name), EXTRA_MSG)
    audience = item.get("audience")
    if not isinstance(audience, str) or not 1 <= len(audience) <= MAX_AUDIENCE_CHARS or not _text(audience):
        return invalid((*loc, "audience"), AUDIENCE_MSG)
    value = item.get(second)
    if not isinstance(value, str):
        return invalid((*loc, second), PAYLOAD_TYPE_MSG if second == "payload" else TOKEN_TYPE_MSG)
    return audience, value


def decode_payload(text: str) -> bytes | str:
    """The bytes of a ``payload`` field, or the reason it is refused (a message for ``detail``)."""
    if len(text) > MAX_PAYLOAD_B64_CHARS:
        return PAYLOAD_SIZE_MSG
    try:
        return b64u_decode(text)
    except MalformedToken:
        return PAYLOAD_B64_MSG


def seal_check(client: Client, item: object, loc: Loc) -> tuple[str, bytes] | Outcome:
    """Validate one seal item: (audience, payload bytes), or the refusal (422, or 403 not granted)."""
    checked = fields(item, loc, "payload")
    if isinstance(checked, Outcome):
        return checked
    audience, text = checked
    payload = decode_payload(text)
    if isinstance(payload, str):
        return invalid((*loc, "payload"), payload)
    if not client.allows("seal", audience):
        return forbidden(audience, "audience")
    return audience, payload


def unseal_check(client: Client, item: object, loc: Loc) -> tuple[str, str] | Outcome:
    """Validate one unseal item: (audience, token), or the refusal (422, or 403 not granted)."""
    checked = fields(item, loc, "token")
    if isinstance(checked, Outcome):
        return checked
    if not client.allows("unseal", checked[0]):
        return forbidden(checked[0], "audience")
    return checked


def batch_items(doc: dict[str, Any], limit: int) -> list[Any] | Outcome:
    """The ``items`` of a batch body (1 to `limit` of them), or the 422 naming the field."""
    for name in doc:
        if name != "items":
            return invalid(("body", name), EXTRA_MSG)
    items = doc.get("items")
    if not isinstance(items, list) or not 1 <= len(items) <= limit:
        return invalid(("body", "items"), f"required: a list of 1 to {limit} items")
    return items
