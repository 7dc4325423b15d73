"""Codecs for the MCP SDK's `RequestStateSecurity(codec=...)`: `seal(bytes) -> str`, `unseal(str) -> bytes`.

Every codec raises the SDK's `InvalidRequestState` for any token it did not mint
unmodified, and nothing else from `unseal`. Names resolve lazily, so importing
this package does not import boto3 or hvac.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["LocalAESGCMCodec"]

if TYPE_CHECKING:
    from mrtr_keys.codecs.local import LocalAESGCMCodec

_LAZY = {
    "LocalAESGCMCodec": "mrtr_keys.codecs.local",
    "VaultTransitCodec": "mrtr_keys.codecs.vault_transit",
    "KMSEnvelopeCodec": "mrtr_keys.codecs.kms",
    "SidecarCodec": "mrtr_keys.codecs.sidecar_client",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mrtr_keys.codecs' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
