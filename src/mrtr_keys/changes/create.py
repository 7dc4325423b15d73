"""Creating a key ring (`mrtr-keys init`): one primary key, generation 1, never over an existing ring."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from mrtr_keys.backends import backend_for, key_format_for
from mrtr_keys.changes.apply import ChangeListener, ChangeResult, notify
from mrtr_keys.changes.scope import check_name
from mrtr_keys.codecs.sdk_v1 import sdk_kid
from mrtr_keys.errors import ConfigError, KeyRingExists
from mrtr_keys.keystores import Keystore
from mrtr_keys.ring.model import (
    DEFAULT_TTL_SECONDS,
    CodecSpec,
    Key,
    KeyFormat,
    KeyRing,
    KeyState,
    check_ttl,
    new_kid,
    new_ring_id,
    utcnow,
)


def create_ring(
    keystore: Keystore,
    *,
    codec: CodecSpec | None = None,
    ttl: float = DEFAULT_TTL_SECONDS,
    audiences: Sequence[str] = (),
    now: datetime | None = None,
    backend_options: dict[str, Any] | None = None,
    listeners: Sequence[ChangeListener] = (),
    key_format: KeyFormat | str | None = None,
) -> ChangeResult:
    """Create a ring with one primary key and store it.

    Args:
        codec: the codec the ring is for (default local).
        key_format: the primary's format (default: the newest its codec seals, ``mk2``; `key_format_for`).
        ttl: the requestState TTL the rotation gate assumes (seconds, > 0).
        audiences: the initial audience scope (empty: any).
        listeners: called with the ``init`` change once the ring is stored (see `mrtr_keys.changes.apply`).

    Raises:
        KeyRingExists: a ring is already stored there (it is left untouched).
        ConfigError: bad TTL, audience or key format; BackendUnavailable: the backend could not make a key.
    """
    ttl = check_ttl(ttl)
    for a in audiences:
        check_name(a)
    if keystore.exists():
        raise KeyRingExists(f"a key ring already exists at {keystore.url}; it is never overwritten")
    now = now or utcnow()
    spec = codec or CodecSpec()
    backend = backend_for(spec, **(backend_options or {}))
    fmt = key_format_for(backend, key_format)
    ring_id = new_ring_id()
    kid = new_kid()
    scope = tuple(dict.fromkeys(audiences))
    key = backend.new_key(ring_id=ring_id, kid=kid, state=KeyState.PRIMARY, audiences=scope, now=now)
    key = replace(key, format=fmt)
    ring = KeyRing(
        ring_id=ring_id, generation=1, keys=(key,), audiences=scope, ttl_seconds=float(ttl), codec=spec, created_at=now
    )
    ring = backend.apply("init", None, ring)
    keystore.create(ring)
    result = ChangeResult(
        "init",
        True,
        ring,
        f"key ring created; primary key {kid} ({fmt.value})",
        details={"new": kid, "format": fmt.value},
    )
    notify(listeners, result, ring, keystore)
    return result


def create_ring_from_sdk_keys(
    keystore: Keystore,
    secrets: Sequence[bytes],
    *,
    ttl: float = DEFAULT_TTL_SECONDS,
    audiences: Sequence[str] = (),
    now: datetime | None = None,
    listeners: Sequence[ChangeListener] = (),
) -> ChangeResult:
    """Create a local ring whose keys are the MCP SDK's ``keys=[...]`` (docs/migration.md).

    ``secrets[0]`` (the key the SDK seals with) becomes the primary, in the ``sdk-v1`` format, so
    codecs over the ring mint and open the SDK's own ``v1.`` tokens; the others become ``verify``
    keys already demoted (the ring starts in phase 2 of a rotation away from them: `rotate retire`
    after TTL + 60 s). Each kid is the one the SDK derives, which `mrtr-keys inspect` shows for a
    ``v1.`` token. `listeners` are called with the ``init`` change, as for `create_ring`.

    Raises:
        KeyRingExists: a ring is already stored there (it is left untouched).
        ConfigError: no secret, a bad TTL or audience, or a secret the SDK refuses.
        KeyRingError: two secrets share an SDK kid.
    """

    ttl = check_ttl(ttl)
    for a in audiences:
        check_name(a)
    if not secrets:
        raise ConfigError("no SDK key to start the ring from")
    if keystore.exists():
        raise KeyRingExists(f"a key ring already exists at {keystore.url}; it is never overwritten")
    now = now or utcnow()
    keys: list[Key] = []
    for i, secret in enumerate(secrets):
        try:
            kid = sdk_kid(bytes(secret))
        except ValueError:
            raise ConfigError(f"keys[{i}] is not a key the MCP SDK takes (at least 32 bytes)") from None
        first = i == 0
        keys.append(
            Key(
                kid=kid,
                state=KeyState.PRIMARY if first else KeyState.VERIFY,
                created_at=now,
                promoted_at=now if first else None,
                demoted_at=None if first else now,
                material=bytes(secret),
                format=KeyFormat.SDK_V1,
            )
        )
    scope = tuple(dict.fromkeys(audiences))
    ring = KeyRing(
        ring_id=new_ring_id(),
        generation=1,
        keys=tuple(keys),
        audiences=scope,
        ttl_seconds=float(ttl),
        codec=CodecSpec(),
        created_at=now,
    )
    keystore.create(ring)
    primary = keys[0].kid
    message = f"key ring created from {len(keys)} MCP SDK key(s); primary key {primary} (SDK format, v1. tokens)"
    details = {"new": primary, "format": KeyFormat.SDK_V1.value, "sdk_keys": [k.kid for k in keys]}
    result = ChangeResult("init", True, ring, message, details=details)
    notify(listeners, result, ring, keystore)
    return result
