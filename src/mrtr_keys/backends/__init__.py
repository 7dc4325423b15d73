"""Key backends: how a key ring's keys are made, and which codec opens them.

A ring records its codec (``{"type": "local"}``, ``"kms"``, ``"vault-transit"``);
`backend_for(ring.codec)` returns the `Backend` for it. A backend is the
key-management half (make a key, react to a lifecycle step); the codec it
opens is the primitive half. Optional backends import their client library
lazily and say which extra to install when it is missing.
"""

from __future__ import annotations

import importlib
from datetime import datetime
from typing import Any, Protocol

from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.errors import ConfigError, check_keywords
from mrtr_keys.keystores import Keystore
from mrtr_keys.ring.model import CodecSpec, Key, KeyFormat, KeyRing, KeyState

_MODULES = {  # one per `mrtr_keys.ring.model.CODEC_TYPES`
    "local": "mrtr_keys.backends.local",
    "kms": "mrtr_keys.backends.kms",
    "vault-transit": "mrtr_keys.backends.vault",
}
BACKEND_OPTIONS: dict[str, frozenset[str]] = {
    "local": frozenset(),
    "kms": frozenset(
        {"client", "service", "kms_key_id", "connect_timeout", "read_timeout", "max_attempts", "kek_check_every"}
    ),
    "vault-transit": frozenset({"client", "settings", "kek_check_every"}),
}
"""The keyword options each backend's ``make_backend`` takes (its client settings). `backend_for` hands a
backend only its own and refuses a keyword no backend takes, so a misspelled setting is an error, not a
silent default (issue 39)."""
ALL_BACKEND_OPTIONS = frozenset().union(*BACKEND_OPTIONS.values())


class Codec(Protocol):
    """The MCP SDK's `RequestStateCodec`, plus `reload()` and `remote_per_token` (True when `seal` or
    `unseal` may call a remote service per token, so a server keeps them off its event loop)."""

    remote_per_token: bool

    def seal(self, payload: bytes) -> str: ...

    def unseal(self, token: str) -> bytes: ...

    def reload(self) -> bool: ...


class Backend(Protocol):
    """The key-management side of one codec type."""

    key_formats: tuple[KeyFormat, ...]
    """The key formats its codec seals (`mrtr_keys.ring.model.KeyFormat`), the one new keys get first:
    ``mk2`` then ``mk1`` for the codecs over the shared token core, only the recorded default for Vault
    transit's remote mode (Vault's own format). `mrtr_keys.changes.create` and ``rotate begin`` set it."""

    def new_key(self, *, ring_id: str, kid: str, state: KeyState, audiences: tuple[str, ...], now: datetime) -> Key:
        """Make a key (material, or a wrapped data key, or a transit version) in `state`.

        Raises:
            BackendUnavailable, MrtrKeysError: the remote service refused or is unreachable.
        """
        ...

    def apply(self, op: str, before: KeyRing | None, after: KeyRing) -> KeyRing:
        """React to a change (``init``, ``begin``, ``promote``, ``retire``, ``audience``, ...)
        before it is saved; may return an adjusted ring (same generation). Default: `after`."""
        ...

    def open_codec(self, keystore: Keystore, *, audience: str, observer: CodecObserver | None = None) -> Codec:
        """The codec for this ring and audience (see `mrtr_keys.request_state_security`)."""
        ...

    def describe_token(self, ring: KeyRing, token: str) -> dict[str, Any] | None:
        """Fields `inspect` shows for a token of this backend's format, or None if it is not one."""
        ...


def key_format_for(backend: Backend, requested: KeyFormat | str | None) -> KeyFormat:
    """The format of a key `backend` makes: `requested` if its codec seals it, else its first (newest) one.

    Raises:
        ConfigError: `requested` is not a format this codec seals (the message lists those it does).
    """
    if requested is None:
        return backend.key_formats[0]
    names = ", ".join(f.value for f in backend.key_formats)
    try:
        wanted = KeyFormat(requested)
    except ValueError:
        raise ConfigError(f"--key-format must be one of {names}, not {str(requested)[:40]!r}") from None
    if wanted not in backend.key_formats:
        raise ConfigError(f"this key ring's codec makes keys of format {names}, not {wanted.value}")
    return wanted


def backend_for(spec: CodecSpec | str, **options: Any) -> Backend:
    """The backend for a codec spec (or type name), with the `options` of `BACKEND_OPTIONS` it takes (the
    others are meant for another codec type, as a fleet's settings cover every ring it may meet).

    Raises:
        ConfigError: unknown codec type, its optional dependency is not installed, or an option no
            backend takes (named with the closest one).
    """
    check_keywords(options, ALL_BACKEND_OPTIONS, "backend_for()")
    if isinstance(spec, str):
        spec = CodecSpec(spec)
    module_name = _MODULES.get(spec.type)
    if module_name is None:
        known = ", ".join(sorted(_MODULES))
        raise ConfigError(f"unknown codec {spec.type!r} (known: {known})")
    module = importlib.import_module(module_name)
    own = BACKEND_OPTIONS[spec.type]
    backend: Backend = module.make_backend(spec, **{k: v for k, v in options.items() if k in own})
    return backend
