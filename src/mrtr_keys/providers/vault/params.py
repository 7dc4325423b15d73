"""A ring's transit settings and the transit wire details both Vault codec modes share.

`TransitParams` (mount, key, mode) comes from the ring's `CodecSpec`; `check_transit_key` refuses a
transit key the codec cannot use safely; the context helpers bind ciphertexts to an audience or to
one ring slot; `split_vault_ciphertext` parses Vault's ``vault:vN:<base64>`` text strictly.
API: https://openbao.org/api-docs/secret/transit/ (same in Vault).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mrtr_keys.errors import ConfigError, KeyRingError
from mrtr_keys.providers.vault.client import VaultClient, VaultRefused
from mrtr_keys.ring.model import CodecSpec, Key

CODEC_TYPE = "vault-transit"
MODES = ("remote", "datakey")
DEFAULT_MOUNT = "transit"
DATAKEY_CONTEXT_INFO = "mrtr-keys/v1/vault-datakey"
"""Prefix of the derivation context that binds a wrapped data key to its ring and kid."""

_VAULT_CIPHERTEXT = re.compile(r"vault:v([1-9][0-9]{0,9}):([A-Za-z0-9+/]*={0,2})")
_TRANSIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_MOUNT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./-]{0,127}")


@dataclass(frozen=True)
class TransitParams:
    """A ring's transit settings (from its `CodecSpec`): mount path, key name, mode."""

    mount: str
    key: str
    mode: str

    @classmethod
    def from_spec(cls, spec: CodecSpec) -> TransitParams:
        """Validate ``{"key", "mode", "mount"}``.

        Raises:
            ConfigError: missing or malformed key name, unknown mode, bad mount path.
        """
        key = spec.params.get("key")
        mode = spec.params.get("mode", "remote")
        mount = spec.params.get("mount", DEFAULT_MOUNT)
        if not isinstance(key, str) or _TRANSIT_NAME.fullmatch(key) is None:
            raise ConfigError("the vault-transit codec needs --transit-key NAME (letters, digits, '_', '-', '.')")
        if mode not in MODES:
            raise ConfigError(f"--mode must be remote or datakey, not {mode!r}")
        if not isinstance(mount, str) or _MOUNT.fullmatch(mount.strip("/")) is None or ".." in mount:
            raise ConfigError(f"--mount {mount!r} is not a Vault mount path")
        return cls(mount=mount.strip("/"), key=key, mode=mode)


def b64(data: bytes) -> str:
    """Standard, padded base64 (RFC 4648 section 4): what transit expects for plaintext and context."""
    return base64.b64encode(data).decode("ascii")


def audience_context(audience: str) -> str:
    """Transit derivation ``context`` for remote-mode tokens: base64 of the audience (UTF-8)."""
    return b64(audience.encode("utf-8", "surrogatepass"))


def datakey_context(ring_id: str, kid: str) -> str:
    """Transit derivation ``context`` for a wrapped data key: binds it to one ring and kid."""
    return b64(f"{DATAKEY_CONTEXT_INFO}:{ring_id}:{kid}".encode())


def vault_ciphertext(version: int, raw: bytes) -> str:
    """Vault's text form ``vault:v{version}:{base64(raw)}``."""
    return f"vault:v{version}:{b64(raw)}"


def split_vault_ciphertext(text: str) -> tuple[int, bytes]:
    """Parse ``vault:vN:<base64>`` strictly into (N, raw bytes).

    Raises:
        ValueError: anything else (non-canonical base64 included).
    """
    match = _VAULT_CIPHERTEXT.fullmatch(text)
    if match is None:
        raise ValueError("not a vault:vN: ciphertext")
    try:
        raw = base64.b64decode(match.group(2), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("ciphertext is not base64") from None
    if b64(raw) != match.group(2):
        raise ValueError("ciphertext base64 is not canonical")
    return int(match.group(1)), raw


def key_version(key: Key) -> int:
    """The transit key version a ring key maps to (``key_data["key_version"]``).

    Raises:
        KeyRingError: missing or not a positive integer.
    """
    version = key.key_data.get("key_version")
    if isinstance(version, bool) or not isinstance(version, int) or not (0 < version < 2**32):
        raise KeyRingError(f"key {key.kid}: key_data.key_version must be a positive integer (transit key version)")
    return version


def create_key_hint(params: TransitParams) -> str:
    """How to create a suitable transit key, for error messages."""
    return (
        f"create one with: bao write -f {params.mount}/keys/{params.key} derived=true "
        f"(vault write ... for Vault; or hvac: client.secrets.transit.create_key({params.key!r}, derived=True, "
        f"mount_point={params.mount!r}))"
    )


def check_transit_key(client: VaultClient, params: TransitParams) -> Mapping[str, Any]:
    """Read the transit key and refuse one this codec cannot use safely; returns the key info.

    Raises:
        ConfigError: no such key, no permission to read it, not derived, convergent, or not an
            encryption key; the message says how to create a suitable one.
        BackendUnavailable: Vault unreachable.
    """
    try:
        info = client.read_key(params.mount, params.key)
    except VaultRefused as exc:
        if exc.status == 404:
            raise ConfigError(
                f"transit key {params.key!r} does not exist at mount {params.mount!r}; {create_key_hint(params)}"
            ) from None
        raise ConfigError(
            f"cannot read transit key {params.key!r} at {params.mount!r} (HTTP {exc.status}); the Vault policy "
            f"needs 'read' on {params.mount}/keys/{params.key} (see docs/vault.md)"
        ) from None
    if info.get("derived") is not True:
        raise ConfigError(
            f"transit key {params.key!r} is not derived, so tokens could not be bound to an audience; "
            f"{create_key_hint(params)}"
        )
    if info.get("convergent_encryption") is True:
        raise ConfigError(
            f"transit key {params.key!r} uses convergent encryption (deterministic); {create_key_hint(params)}"
        )
    if info.get("supports_encryption") is False or info.get("supports_derivation") is False:
        raise ConfigError(f"transit key {params.key!r} cannot encrypt with derivation; {create_key_hint(params)}")
    return info
