"""Creating a key ring (`mrtr-keys init`): one primary key, generation 1, never over an existing ring."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from mrtr_keys.backends import backend_for
from mrtr_keys.errors import KeyRingExists
from mrtr_keys.keystores import Keystore
from mrtr_keys.ring.apply import ChangeResult, _listeners
from mrtr_keys.ring.model import (
    DEFAULT_TTL_SECONDS,
    CodecSpec,
    KeyRing,
    KeyState,
    check_ttl,
    new_kid,
    new_ring_id,
    utcnow,
)
from mrtr_keys.ring.scope import check_name


def create_ring(
    keystore: Keystore,
    *,
    codec: CodecSpec | None = None,
    ttl: float = DEFAULT_TTL_SECONDS,
    audiences: Sequence[str] = (),
    now: datetime | None = None,
    backend_options: dict[str, Any] | None = None,
) -> ChangeResult:
    """Create a ring with one primary key and store it.

    Args:
        codec: the codec the ring is for (default local).
        ttl: the requestState TTL the rotation gate assumes (seconds, > 0).
        audiences: the initial audience scope (empty: any).

    Raises:
        KeyRingExists: a ring is already stored there (it is left untouched).
        ConfigError: bad TTL or audience; BackendUnavailable: the backend could not make a key.
    """
    ttl = check_ttl(ttl)
    for a in audiences:
        check_name(a)
    if keystore.exists():
        raise KeyRingExists(f"a key ring already exists at {keystore.url}; it is never overwritten")
    now = now or utcnow()
    spec = codec or CodecSpec()
    backend = backend_for(spec, **(backend_options or {}))
    ring_id = new_ring_id()
    kid = new_kid()
    scope = tuple(dict.fromkeys(audiences))
    key = backend.new_key(ring_id=ring_id, kid=kid, state=KeyState.PRIMARY, audiences=scope, now=now)
    ring = KeyRing(
        ring_id=ring_id, generation=1, keys=(key,), audiences=scope, ttl_seconds=float(ttl), codec=spec, created_at=now
    )
    ring = backend.apply("init", None, ring)
    keystore.create(ring)
    result = ChangeResult("init", True, ring, f"key ring created; primary key {kid}", details={"new": kid})
    for listener in list(_listeners):
        listener(result, ring, keystore)
    return result
