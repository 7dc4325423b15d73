"""mrtr-keys: shared, rotated, audited keys for MCP `requestState` (protocol 2026-07-28).

    from mcp.server.mcpserver import MCPServer
    import mrtr_keys

    mcp = MCPServer("billing", request_state_security=mrtr_keys.request_state_security(
        ".mrtr/keyring.json", audience="billing"))

Importing this package has no side effects and loads nothing heavy; names are
resolved on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mrtr_keys.version import __version__ as __version__

__all__ = ["LocalAESGCMCodec", "harden_process", "open_codec", "open_keystore", "request_state_security"]

if TYPE_CHECKING:
    from mrtr_keys.codecs.local import LocalAESGCMCodec
    from mrtr_keys.factory import open_codec, request_state_security
    from mrtr_keys.hardening import harden_process
    from mrtr_keys.keystores import open_keystore

_LAZY = {
    "request_state_security": "mrtr_keys.factory",
    "open_codec": "mrtr_keys.factory",
    "harden_process": "mrtr_keys.hardening",
    "open_keystore": "mrtr_keys.keystores",
    "LocalAESGCMCodec": "mrtr_keys.codecs.local",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mrtr_keys' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
