"""Where key rings live. `open_keystore(location)` picks the keystore from a path or URL.

Every keystore offers the same small contract (`Keystore`): load the ring,
create it once, and save a new generation with compare-and-swap, so two
writers can never both win; and a cheap `revision()` that changes whenever the
stored ring does (the ring watcher, `mrtr_keys.keystores.watch`, polls it).
Local files a process keeps for a ring (audit key, audit log, client registry,
lock files) go to its state directory (`Keystore.directory`,
`mrtr_keys.keystores.state`).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from mrtr_keys.errors import ConfigError, refuse_nul
from mrtr_keys.ring.model import KeyRing
from mrtr_keys.urls import redact

ENV_KEYSTORE = "MRTR_KEYS_KEYSTORE"
DEFAULT_KEYSTORE = ".mrtr/keyring.json"
"""Used when neither ``--keystore`` nor ``MRTR_KEYS_KEYSTORE`` is given (relative to the working directory)."""


class Keystore(Protocol):
    """Storage for one key ring."""

    @property
    def url(self) -> str:
        """Where the ring lives, as a URL with no secret in it."""
        ...

    @property
    def directory(self) -> Path:
        """The state directory: local files kept for this ring (audit key, default audit log, client
        registry, lock files); see `mrtr_keys.keystores.state`. Created on first use when needed.

        Raises:
            ConfigError: it cannot be created.
        """
        ...

    def exists(self) -> bool:
        """True if a ring is stored there."""
        ...

    def load(self) -> KeyRing:
        """Read and validate the ring.

        Raises:
            KeyRingNotFound, KeystoreError, KeyRingError.
        """
        ...

    def revision(self) -> str | None:
        """A cheap opaque string that changes whenever the stored ring changes (no full read).

        Equal strings mean "unchanged since then"; the value means nothing else. None: this
        keystore has no cheap check, so a watcher reads the whole ring each time.

        Raises:
            KeystoreError: the keystore cannot be reached (KeyRingNotFound: no ring there).
        """
        ...

    def create(self, ring: KeyRing) -> None:
        """Store a first ring. Raises `KeyRingExists` if one is there (never overwrites)."""
        ...

    def save(self, ring: KeyRing, *, expected_generation: int) -> None:
        """Replace the ring if the stored generation is still `expected_generation`.

        Raises:
            ConflictError: another writer got there first; nothing was written.
        """
        ...

    def locked(self) -> AbstractContextManager[None]:
        """Serialise read-modify-write sequences of cooperating writers (advisory)."""
        ...


def resolve_location(location: str | os.PathLike[str] | None) -> str:
    """The keystore location from the argument, else ``MRTR_KEYS_KEYSTORE``, else `DEFAULT_KEYSTORE`."""
    if location is not None and str(location):
        return str(location)
    return os.environ.get(ENV_KEYSTORE) or DEFAULT_KEYSTORE


def open_keystore(
    location: str | os.PathLike[str] | None = None, *, state_dir: str | os.PathLike[str] | None = None
) -> Keystore:
    """Open the keystore at a path or URL (docs/keystores.md).

    * a path or ``file:///PATH``: a JSON file (`FileKeystore`), or, when its directory is a
      read-only mount such as a Kubernetes Secret volume, a `MountedKeystore`;
    * ``vault-kv://MOUNT/PATH``: a Vault / OpenBao KV version 2 secret (`VaultKVKeystore`);
    * ``aws-sm://NAME``: an AWS Secrets Manager secret, by name or ARN (`SecretsManagerKeystore`).

    `state_dir` overrides ``MRTR_KEYS_STATE_DIR`` (`mrtr_keys.keystores.state`).

    Raises:
        ConfigError: an unsupported URL scheme, a malformed URL, or a NUL byte (also as ``%00``).
    """
    text = resolve_location(location)
    refuse_nul(text, "a keystore location")
    _refuse_typo(text)
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme in ("", "file"):
        from mrtr_keys.keystores.file import FileKeystore, path_from_url
        from mrtr_keys.keystores.private import is_read_only_mount

        path = Path(text).expanduser().absolute() if not scheme else path_from_url(text)
        if is_read_only_mount(path.parent):
            from mrtr_keys.keystores.mounted import MountedKeystore

            return MountedKeystore(path, state_dir=state_dir)
        return FileKeystore(path, state_dir=state_dir)
    if scheme == "vault-kv":
        from mrtr_keys.keystores.vault_kv import VaultKVKeystore

        return VaultKVKeystore.from_url(text, state_dir=state_dir)
    if scheme == "aws-sm":
        from mrtr_keys.keystores.aws_sm import SecretsManagerKeystore

        return SecretsManagerKeystore.from_url(text, state_dir=state_dir)
    raise ConfigError(
        f"unsupported keystore URL scheme {scheme!r} (use a path, file:///PATH, vault-kv://MOUNT/PATH or aws-sm://NAME)"
    )


KNOWN_SCHEMES = ("file", "vault-kv", "aws-sm")


def _refuse_typo(text: str) -> None:
    """Refuse ``vault-kv:/secret/x`` or ``aws-sm:name`` (a known scheme without ``//``), which would
    otherwise be a relative path under a directory named ``vault-kv:``; the message gives the right spelling.

    Raises:
        ConfigError: `text` starts with a known scheme and a colon but not ``://``.
    """
    head, colon, rest = text.partition(":")
    if not colon or "://" in text or head.lower() not in KNOWN_SCHEMES:
        return
    scheme = head.lower()
    rest = rest.lstrip("/")
    right = f"file:///{rest}" if scheme == "file" else f"{scheme}://{rest}"
    raise ConfigError(
        f"malformed keystore URL {redact(text)[:80]!r}: {scheme} URLs need '//' after the scheme; "
        f"did you mean {redact(right)[:80]!r}?"
    )


def as_keystore(keystore: Keystore | str | os.PathLike[str] | None) -> Keystore:
    """`keystore` itself when it is already a keystore object, else `open_keystore(keystore)` (a path,
    a URL, or None for ``MRTR_KEYS_KEYSTORE`` / the default)."""
    if keystore is None or isinstance(keystore, str | os.PathLike):
        return open_keystore(keystore)
    return keystore
