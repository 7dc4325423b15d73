"""Reading a key ring document (JSON, see `mrtr_keys.ring.model`) into a `KeyRing`, strictly.

Every refusal is one `KeyRingError` line that says what is wrong and never echoes key material;
the ring-wide invariants (one primary, unique kids, sizes) are checked when the `KeyRing` is built.
"""

from __future__ import annotations

import json

from mrtr_keys.errors import KeyRingError
from mrtr_keys.ring.model import (
    DEFAULT_TTL_SECONDS,
    FORMAT,
    KEY_BYTES,
    VERSION,
    CodecSpec,
    Key,
    KeyFormat,
    KeyRing,
    KeyState,
    TtlLowering,
    parse_time,
)
from mrtr_keys.ring.sdk_keys import decode_sdk_key, strict_b64decode
from mrtr_keys.token import KID_PATTERN


def parse_ring(data: bytes | str) -> KeyRing:
    """Parse and validate a key ring document (UTF-8 JSON text).

    Raises:
        KeyRingError: one line saying what is wrong; never echoes key material.
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise KeyRingError("key ring is not valid JSON") from None
    except RecursionError:
        raise KeyRingError("key ring JSON is nested too deeply") from None
    return ring_from_json(doc)


def ring_from_json(doc: object) -> KeyRing:
    """A `KeyRing` from a parsed document.

    Raises:
        KeyRingError: a missing or malformed field (``created_at`` included: a ring's creation time
            is never guessed), or a broken invariant.
    """
    if not isinstance(doc, dict):
        raise KeyRingError("key ring must be a JSON object")
    if doc.get("format") != FORMAT:
        raise KeyRingError(f"not a key ring document (format must be {FORMAT!r})")
    if doc.get("version") != VERSION:
        raise KeyRingError(f"unsupported key ring version {doc.get('version')!r} (this build reads {VERSION})")
    codec_doc = doc.get("codec", {"type": "local"})
    if not isinstance(codec_doc, dict) or not isinstance(codec_doc.get("type"), str):
        raise KeyRingError("codec must be an object with a string 'type'")
    codec = CodecSpec(codec_doc["type"], {k: v for k, v in codec_doc.items() if k != "type"})
    raw_keys = doc.get("keys")
    if not isinstance(raw_keys, list):
        raise KeyRingError("keys must be a list")
    keys = tuple(_key_from_json(entry, i, codec.type) for i, entry in enumerate(raw_keys))
    audiences = doc.get("audiences", [])
    if not isinstance(audiences, list) or not all(isinstance(a, str) for a in audiences):
        raise KeyRingError("audiences must be a list of strings")
    ttl = doc.get("ttl_seconds", DEFAULT_TTL_SECONDS)
    generation = doc.get("generation")
    ring_id = doc.get("ring_id")
    if not isinstance(ring_id, str):
        raise KeyRingError("ring_id must be a string")
    if isinstance(generation, bool) or not isinstance(generation, int):
        raise KeyRingError("generation must be an integer")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise KeyRingError("ttl_seconds must be a number")
    created = parse_time(doc.get("created_at"), "created_at")
    if created is None:
        raise KeyRingError("created_at is required (the time the ring was made, UTC, ISO 8601)")
    return KeyRing(
        ttl_lowering=_lowering_from_json(doc.get("ttl_lowering")),
        ring_id=ring_id,
        generation=generation,
        keys=keys,
        audiences=tuple(audiences),
        ttl_seconds=float(ttl),
        codec=codec,
        created_at=created,
        seal_budget=_budget(doc.get("seal_budget"), "seal_budget"),
    )


def _lowering_from_json(value: object) -> TtlLowering | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise KeyRingError("ttl_lowering must be an object")
    ttl = value.get("ttl_seconds")
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise KeyRingError("ttl_lowering.ttl_seconds must be a number")
    at = parse_time(value.get("requested_at"), "ttl_lowering.requested_at")
    if at is None:
        raise KeyRingError("ttl_lowering.requested_at is required")
    return TtlLowering(float(ttl), at)


def _key_from_json(entry: object, index: int, codec_type: str) -> Key:
    if not isinstance(entry, dict):
        raise KeyRingError(f"keys[{index}] must be an object")
    kid = entry.get("kid")
    if not isinstance(kid, str) or KID_PATTERN.fullmatch(kid) is None:
        raise KeyRingError(f"keys[{index}].kid must be 8 lowercase hex characters")
    try:
        state = KeyState(str(entry.get("state")))
    except ValueError:
        raise KeyRingError(f"key {kid}: state must be verify, primary, retired or revoked") from None
    try:
        key_format = KeyFormat(str(entry.get("format", KeyFormat.MK1.value)))
    except ValueError:
        raise KeyRingError(f"key {kid}: format must be mk1, mk2 or sdk-v1") from None
    material: bytes | None = None
    raw_material = entry.get("material")
    destroyed = parse_time(entry.get("destroyed_at"), f"key {kid} destroyed_at")
    if key_format is KeyFormat.SDK_V1:
        if raw_material is not None or codec_type != "local":
            raise KeyRingError(f"key {kid}: an sdk-v1 key lives only in a local ring, as sdk_key (not material)")
        if destroyed is None or "sdk_key" in entry:
            material = decode_sdk_key(entry.get("sdk_key"), kid)
    elif "sdk_key" in entry:
        raise KeyRingError(f"key {kid}: sdk_key belongs to an sdk-v1 key (add format: sdk-v1)")
    elif raw_material is not None:
        material = _decode_material(raw_material, kid)
    key_data = entry.get("key_data", {})
    if not isinstance(key_data, dict):
        raise KeyRingError(f"key {kid}: key_data must be an object")
    if codec_type == "local" and material is None and destroyed is None:
        raise KeyRingError(f"key {kid}: missing material (base64 of {KEY_BYTES} bytes)")
    created = parse_time(entry.get("created_at"), f"key {kid} created_at")
    if created is None:
        raise KeyRingError(f"key {kid}: created_at is required")
    reason, by = entry.get("revoked_reason"), entry.get("revoked_by")
    if not (reason is None or isinstance(reason, str)) or not (by is None or isinstance(by, str)):
        raise KeyRingError(f"key {kid}: revoked_reason and revoked_by must be strings")
    return Key(
        kid=kid,
        state=state,
        created_at=created,
        promoted_at=parse_time(entry.get("promoted_at"), f"key {kid} promoted_at"),
        demoted_at=parse_time(entry.get("demoted_at"), f"key {kid} demoted_at"),
        retired_at=parse_time(entry.get("retired_at"), f"key {kid} retired_at"),
        material=material,
        key_data=key_data,
        destroyed_at=destroyed,
        format=key_format,
        revoked_at=parse_time(entry.get("revoked_at"), f"key {kid} revoked_at"),
        revoked_reason=reason,
        revoked_by=by,
        budget=_budget(entry.get("budget"), f"key {kid}: budget"),
    )


def _budget(value: object, what: str) -> int | None:
    """A seal budget as stored (None when absent); the range is checked with the ring (`KeyRing`)."""
    if value is None:
        return None
    if type(value) is not int:
        raise KeyRingError(f"{what} must be a whole number of seals")
    return value


def _decode_material(value: object, kid: str) -> bytes:
    """Strict standard base64 of exactly 32 bytes; the error never echoes the value."""
    expected = f"key {kid}: material must be standard base64 of {KEY_BYTES} bytes"
    if not isinstance(value, str) or not value.isascii():
        raise KeyRingError(expected)
    if len(value) == 2 * KEY_BYTES and all(c in "0123456789abcdefABCDEF" for c in value):
        raise KeyRingError(f"{expected} (it looks like {2 * KEY_BYTES} hex characters; write the bytes as base64)")
    raw = strict_b64decode(value, expected)
    if len(raw) != KEY_BYTES:
        hint = "; a passphrase or text is not a key" if len(value) == KEY_BYTES else ""
        raise KeyRingError(f"{expected} (it decodes to {len(raw)} bytes{hint})")
    return raw
