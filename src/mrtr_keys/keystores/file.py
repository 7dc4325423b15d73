"""File keystore: one JSON document, written atomically, mode 0600, CAS on the generation.

Writes go to a temporary file in the same directory, are fsynced, then renamed
over the ring (POSIX `rename` is atomic), and the directory is fsynced, so a
reader sees the old ring or the new one, never half of either; a failed write
leaves the old file as it was. Every write holds an exclusive `flock` on a
sibling ``.lock`` file while it compares the stored generation with the one
the writer read: two concurrent runs can never both win.

A ring file readable or writable by group or others is refused on load, as
ssh refuses a private key with such a mode.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from urllib.parse import unquote, urlparse

from mrtr_keys.errors import (
    ConfigError,
    ConflictError,
    KeyRingExists,
    KeyRingNotFound,
    KeystoreError,
)
from mrtr_keys.keystores.locks import LocalLock, lock_timeout_from_env
from mrtr_keys.keystores.private import read_private_file
from mrtr_keys.keystores.state import configured_state_dir, ensure_dir, user_state_dir, writable_dir
from mrtr_keys.ring.document import parse_ring
from mrtr_keys.ring.model import KeyRing

MAX_RING_BYTES = 4 * 1024 * 1024


def path_from_url(url: str) -> Path:
    """The local path a ``file:///PATH`` URL names.

    Raises:
        ConfigError: a host other than localhost, or no path.
    """
    try:
        parsed = urlparse(url)
    except ValueError as exc:  # "file://[::1/x": an unclosed IPv6 host
        raise ConfigError(f"cannot read the keystore URL {url!r}: {exc} (file:///PATH)") from None
    if parsed.netloc not in ("", "localhost"):
        raise ConfigError("a file:// keystore URL names a local path (file:///PATH)")
    if not parsed.path:
        raise ConfigError("a file:// keystore URL needs a path (file:///PATH)")
    return Path(unquote(parsed.path))


class FileKeystore:
    """A key ring stored in one local file."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        lock_timeout: float | None = None,
        state_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.path = Path(path).expanduser().absolute()
        self.state_dir = state_dir
        self.lock_timeout = lock_timeout_from_env(lock_timeout)
        self._lock = LocalLock(self._lock_path, subject=f"key ring {self.path}", timeout=self.lock_timeout)

    @classmethod
    def from_url(cls, url: str, *, state_dir: str | os.PathLike[str] | None = None) -> FileKeystore:
        """Open ``file:///absolute/path`` (or ``file:relative``)."""
        return cls(path_from_url(url), state_dir=state_dir)

    def __repr__(self) -> str:
        return f"FileKeystore({str(self.path)!r})"

    @property
    def url(self) -> str:
        return self.path.as_uri()

    @property
    def directory(self) -> Path:
        """The state directory (`mrtr_keys.keystores.state`): beside the ring unless configured or unwritable."""
        configured = configured_state_dir(self.state_dir)
        if configured is not None:
            return ensure_dir(configured)
        parent = self.path.parent
        if not parent.exists() or writable_dir(parent):
            return parent
        return ensure_dir(user_state_dir(self.url))

    @property
    def _lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> KeyRing:
        missing = KeyRingNotFound(f"no key ring at {self.path} (create one with: mrtr-keys init)")
        return parse_ring(read_private_file(self.path, "key ring", max_bytes=MAX_RING_BYTES, missing=missing))

    def revision(self) -> str:
        """``inode:size:mtime_ns:mode:uid:gid`` of the ring file, one ``stat`` and no read: every write
        renames a new file over it (a new inode), so any change shows; and so does a ``chmod`` or
        ``chown`` that would make a restart refuse the file (mode 0644), at the next check, not at
        the next restart (issue 22).

        Raises:
            KeyRingNotFound: no file; KeystoreError: it cannot be examined.
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise KeyRingNotFound(f"no key ring at {self.path} (create one with: mrtr-keys init)") from None
        except OSError as exc:
            raise KeystoreError(f"cannot examine key ring {self.path}: {exc.strerror}") from None
        return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_mode:o}:{st.st_uid}:{st.st_gid}"

    def create(self, ring: KeyRing) -> None:
        with self.locked():
            if self.path.exists():
                raise KeyRingExists(f"a key ring already exists at {self.path}; it is never overwritten")
            self._write(ring)

    def save(self, ring: KeyRing, *, expected_generation: int) -> None:
        with self.locked():
            current = self.load()
            if current.generation != expected_generation:
                raise ConflictError(
                    f"key ring {self.path} changed while this run was working "
                    f"(generation {expected_generation} read, {current.generation} now); nothing was written, "
                    "run the command again"
                )
            if ring.generation <= current.generation:
                raise ConflictError("a saved key ring must have a higher generation than the stored one")
            self._write(ring)

    def locked(self) -> AbstractContextManager[None]:
        """Hold an exclusive advisory lock on ``<ring>.lock`` beside the ring (re-entrant within one
        thread; `mrtr_keys.keystores.locks`). It stays beside the ring whatever the state directory,
        because the compare-and-swap in `save` relies on every writer of this file taking it."""
        return self._lock.held()

    def _write(self, ring: KeyRing) -> None:
        data = ring.dumps()
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=directory)
        except OSError as exc:
            raise KeystoreError(f"cannot write key ring {self.path}: {exc.strerror}") from None
        try:
            try:
                os.fchmod(fd, 0o600)
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise KeystoreError(
                f"cannot write key ring {self.path}: {exc.strerror}; the old ring is unchanged"
            ) from None
        with contextlib.suppress(OSError):
            dfd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
