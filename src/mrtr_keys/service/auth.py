"""Client authentication for the sidecar: a bearer secret (RFC 6750), checked against the client registry.

`ClientAuth` holds the loaded `ClientRegistry` and swaps it when the file on
disk changes: polled by the reload loop, and checked (one ``stat``) whenever a
secret is not found, so a client added with ``mrtr-keys clients add`` works on
its very first request. A registry file that fails to parse never replaces the
loaded one. Secrets are never logged; lookups go through
`ClientRegistry.authenticate` (SHA-256, O(1) dict, constant-time compare).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from mrtr_keys.errors import MrtrKeysError
from mrtr_keys.service.clients import Client, ClientRegistry, FileStamp, file_stamp, load_registry

log = logging.getLogger("mrtr_keys.service")

_BEARER = b"bearer "
MAX_SECRET_BYTES = 512


def bearer_secret(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The credentials of an ``Authorization: Bearer <secret>`` header (ASGI raw headers), or None.

    The scheme name is case-insensitive (RFC 7235 section 2.1); anything else, an empty or over-long
    secret, is None (the caller answers 401).
    """
    for name, value in headers:
        if name == b"authorization":
            if len(value) > len(_BEARER) + MAX_SECRET_BYTES or value[:7].lower() != _BEARER:
                return None
            secret = value[7:].strip()
            return secret or None
    return None


class ClientAuth:
    """The live client registry of one sidecar process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: FileStamp = file_stamp(path)
        self.registry: ClientRegistry = load_registry(path)
        self.error: str | None = None

    def authenticate(self, secret: bytes) -> Client | None:
        """The client owning `secret`, re-reading the registry first if it changed on disk."""
        client = self.registry.authenticate(secret)
        if client is None:
            # Look again whatever refresh() says: the reload loop may have just swapped the registry in
            # another thread, in which case our refresh finds nothing new but the registry is.
            self.refresh()
            client = self.registry.authenticate(secret)
        return client

    def refresh(self) -> bool:
        """Reload the registry if its file changed; True if a new registry is now in use.

        A broken file is logged and leaves the loaded registry in place.
        """
        stamp = file_stamp(self.path)
        if stamp == self._stamp:
            return False
        with self._lock:
            if stamp == self._stamp:
                return False
            try:
                registry = load_registry(self.path)
            except MrtrKeysError as exc:
                if self.error != str(exc):
                    log.warning("client registry not reloaded (keeping the loaded one): %s", exc)
                self.error = str(exc)
                self._stamp = stamp
                return False
            self.registry, self._stamp, self.error = registry, stamp, None
        log.info("client registry reloaded: %d client(s)", len(registry))
        return True
