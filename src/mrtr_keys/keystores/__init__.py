"""Where key rings live. `open_keystore(location)` picks the keystore from a path or URL.

Every keystore offers the same small contract (`Keystore`): load the ring,
create it once, and save a new generation with compare-and-swap on the
generation, so two writers can never both win.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from mrtr_keys.errors import ConfigError
from mrtr_keys.ring.model import KeyRing

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
        """A local directory for files kept beside the ring (client registry, audit key, audit log)."""
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


def open_keystore(location: str | os.PathLike[str] | None = None) -> Keystore:
    """Open the keystore at a path or ``file://`` URL.

    Raises:
        ConfigError: an unsupported URL scheme.
    """
    text = resolve_location(location)
    if "://" not in text:
        from mrtr_keys.keystores.file import FileKeystore

        return FileKeystore(Path(text))
    scheme = text.split("://", 1)[0]
    if scheme == "file":
        from mrtr_keys.keystores.file import FileKeystore

        return FileKeystore.from_url(text)
    raise ConfigError(f"unsupported keystore URL scheme {scheme!r} (use a path or file:///PATH)")


def iter_schemes() -> Iterator[str]:
    """Keystore URL schemes this build understands."""
    yield "file"
