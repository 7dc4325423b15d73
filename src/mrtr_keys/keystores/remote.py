"""What the remote keystores (Vault KV, Secrets Manager) share: state directory, local lock, CAS bookkeeping.

A remote keystore's compare-and-swap is the service's own (Vault's ``cas``, moving Secrets
Manager's ``AWSCURRENT`` label off the version read), so it needs the service's version of the ring
a writer read: `_remember` records it on every load, keyed by generation, and `_version_for` finds
it at save time (reading the store again when the writer's ring came from elsewhere). A local lock
file in the state directory (`LocalLock`) makes cooperating writers on one host queue instead of
losing races to each other; writers on other hosts are kept apart by the CAS alone.
"""

from __future__ import annotations

import hashlib
import os
import threading
from contextlib import AbstractContextManager
from pathlib import Path

from mrtr_keys.errors import ConflictError, KeyRingError
from mrtr_keys.keystores.locks import LocalLock, lock_timeout_from_env
from mrtr_keys.keystores.state import configured_state_dir, ensure_dir, user_state_dir
from mrtr_keys.ring.document import parse_ring
from mrtr_keys.ring.model import KeyRing

MAX_RING_BYTES = 4 * 1024 * 1024
"""Largest stored ring accepted (bytes); Secrets Manager's own limit is 64 KiB, Vault's 32 MiB request size."""


class RemoteKeystore:
    """Base of `VaultKVKeystore` and `SecretsManagerKeystore`; subclasses supply `url`, `load` and
    `_current_version() -> (generation, version) | None`."""

    url: str

    def __init__(self, *, state_dir: str | os.PathLike[str] | None, lock_timeout: float | None = None) -> None:
        self.state_dir = state_dir
        self._lock_timeout = lock_timeout_from_env(lock_timeout)
        self._lock: LocalLock | None = None
        self._versions: dict[int, str] = {}
        self._versions_lock = threading.Lock()

    @property
    def directory(self) -> Path:
        """The state directory: ``--state-dir`` / ``MRTR_KEYS_STATE_DIR``, else per user and per keystore."""
        configured = configured_state_dir(self.state_dir)
        return ensure_dir(configured if configured is not None else user_state_dir(self.url))

    def locked(self) -> AbstractContextManager[None]:
        """A lock file in the state directory, named after the keystore (re-entrant per thread)."""
        if self._lock is None:
            digest = hashlib.sha256(self.url.encode("utf-8")).hexdigest()[:12]
            self._lock = LocalLock(
                self.directory / f"keystore-{digest}.lock", subject=f"key ring {self.url}", timeout=self._lock_timeout
            )
        return self._lock.held()

    def _parse(self, data: bytes | str) -> KeyRing:
        if len(data) > MAX_RING_BYTES:
            raise KeyRingError(f"key ring at {self.url} is larger than {MAX_RING_BYTES} bytes")
        return parse_ring(data)

    def _remember(self, ring: KeyRing, version: str) -> None:
        with self._versions_lock:
            if len(self._versions) > 64:
                self._versions.clear()
            self._versions[ring.generation] = version

    def _current_version(self) -> tuple[int, str] | None:
        raise NotImplementedError

    def _version_for(self, ring: KeyRing, expected_generation: int) -> str:
        """The service's version id of the stored ring with `expected_generation`.

        Raises:
            ConflictError: the store moved on (or never had that generation), or `ring` does not
                raise the generation.
        """
        with self._versions_lock:
            version = self._versions.get(expected_generation)
        if version is None:
            current = self._current_version()
            if current is None or current[0] != expected_generation:
                raise self._conflict(expected_generation, None if current is None else current[0])
            version = current[1]
        if ring.generation <= expected_generation:
            raise ConflictError("a saved key ring must have a higher generation than the stored one")
        return version

    def _conflict(self, expected: int, now: int | None) -> ConflictError:
        where = f"{now} now" if now is not None else "another version now"
        return ConflictError(
            f"key ring {self.url} changed while this run was working (generation {expected} read, {where}); "
            "nothing was written, run the command again"
        )
