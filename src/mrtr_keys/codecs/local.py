"""`LocalAESGCMCodec`: AES-256-GCM with key material held in the key ring itself."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from mrtr_keys.codecs.base import KeyRingCodec
from mrtr_keys.errors import KeyRingError
from mrtr_keys.ring.model import KeyRing


class LocalAESGCMCodec(KeyRingCodec):
    """Seals with the ring's primary key; unseals with the key the token's kid names.

    Drop-in for the MCP SDK: ``RequestStateSecurity(codec=LocalAESGCMCodec(path, audience="svc"))``.
    The token format is `mrtr_keys.codecs.aesgcm` (docs/token-format.md); every
    failure of `unseal` is the SDK's `InvalidRequestState`.
    """

    codec_type: ClassVar[str] = "local"

    def _ring_keys(self, ring: KeyRing) -> Mapping[str, bytes]:
        keys: dict[str, bytes] = {}
        for key in ring.usable_keys():
            if key.material is None:
                raise KeyRingError(f"key {key.kid}: no material in a local key ring")
            keys[key.kid] = key.material
        return keys
