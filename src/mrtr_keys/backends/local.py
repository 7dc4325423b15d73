"""Local backend: 32 random bytes per key, stored in the ring; opened by `LocalAESGCMCodec`."""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

from mrtr_keys.codecs.aesgcm import MK2_PREFIX, TOKEN_PREFIX, describe_token
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.codecs.sdk_v1 import SDK_PREFIX, describe_sdk_token
from mrtr_keys.keystores import Keystore
from mrtr_keys.ring.model import KEY_BYTES, CodecSpec, Key, KeyFormat, KeyRing, KeyState


class LocalBackend:
    """Key material from `os.urandom` (32 bytes), kept base64 in the ring file (mode 0600)."""

    key_formats = (KeyFormat.MK2, KeyFormat.MK1)

    def __init__(self, spec: CodecSpec) -> None:
        self.spec = spec

    def new_key(self, *, ring_id: str, kid: str, state: KeyState, audiences: tuple[str, ...], now: datetime) -> Key:
        promoted = now if state is KeyState.PRIMARY else None
        return Key(kid=kid, state=state, created_at=now, promoted_at=promoted, material=os.urandom(KEY_BYTES))

    def apply(self, op: str, before: KeyRing | None, after: KeyRing) -> KeyRing:
        return after

    def open_codec(
        self, keystore: Keystore, *, audience: str, observer: CodecObserver | None = None
    ) -> LocalAESGCMCodec:
        return LocalAESGCMCodec(keystore, audience=audience, observer=observer)

    def describe_token(self, ring: KeyRing, token: str) -> dict[str, Any] | None:
        if token.startswith(SDK_PREFIX) and any(k.format is KeyFormat.SDK_V1 for k in ring.keys):
            return describe_sdk_token(ring, token)  # only a ring adopted from MCP SDK keys opens v1. tokens
        if not token.startswith((TOKEN_PREFIX, MK2_PREFIX)):
            return None
        return describe_token(ring, token)


def make_backend(spec: CodecSpec) -> LocalBackend:
    """`backend_for` entry point (a local ring takes no client settings)."""
    return LocalBackend(spec)
