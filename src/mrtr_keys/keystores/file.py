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
import fcntl
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from mrtr_keys.errors import (
    ConfigError,
    ConflictError,
    KeyRingExists,
    KeyRingNotFound,
    KeystoreBusy,
    KeystoreError,
)
from mrtr_keys.ring.model import KeyRing

MAX_RING_BYTES = 4 * 1024 * 1024
DEFAULT_LOCK_TIMEOUT = 30.0
"""Seconds a writer waits for another run's lock before giving up (exit 75)."""


class FileKeystore:
    """A key ring stored in one local file."""

    def __init__(self, path: str | os.PathLike[str], *, lock_timeout: float | None = None) -> None:
        self.path = Path(path).expanduser().absolute()
        if lock_timeout is None:
            try:
                lock_timeout = float(os.environ.get("MRTR_KEYS_LOCK_TIMEOUT", DEFAULT_LOCK_TIMEOUT))
            except ValueError:
                raise ConfigError("MRTR_KEYS_LOCK_TIMEOUT must be a number of seconds") from None
        if not 0 <= lock_timeout <= 3600:
            raise ConfigError("the key ring lock timeout must be between 0 and 3600 seconds")
        self.lock_timeout = lock_timeout
        self._local = threading.local()  # which threads hold `locked()` (re-entrancy is per thread)

    @classmethod
    def from_url(cls, url: str) -> FileKeystore:
        """Open ``file:///absolute/path`` (or ``file:relative``)."""
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError("a file:// keystore URL names a local path (file:///PATH)")
        if not parsed.path:
            raise ConfigError("a file:// keystore URL needs a path (file:///PATH)")
        return cls(unquote(parsed.path))

    def __repr__(self) -> str:
        return f"FileKeystore({str(self.path)!r})"

    @property
    def url(self) -> str:
        return self.path.as_uri()

    @property
    def directory(self) -> Path:
        return self.path.parent

    @property
    def _lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def exists(self) -> bool:
        return self.path.exists()

    def load(self) -> KeyRing:
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise KeyRingNotFound(f"no key ring at {self.path} (create one with: mrtr-keys init)") from None
        except OSError as exc:
            raise KeystoreError(f"cannot open key ring {self.path}: {exc.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise KeystoreError(f"key ring {self.path} is not a regular file")
        with os.fdopen(fd, "rb") as f:
            if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise KeystoreError(
                    f"key ring {self.path} is accessible by group or others "
                    f"(mode {stat.S_IMODE(st.st_mode):04o}); fix with: chmod 600 {self.path}"
                )
            try:
                data = f.read(MAX_RING_BYTES + 1)
            except OSError as exc:
                raise KeystoreError(f"cannot read key ring {self.path}: {exc.strerror}") from None
        if len(data) > MAX_RING_BYTES:
            raise KeystoreError(f"key ring {self.path} is larger than {MAX_RING_BYTES} bytes")
        return KeyRing.loads(data)

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

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold an exclusive advisory lock on ``<ring>.lock`` (re-entrant within one thread).

        Each call opens its own descriptor, and `flock` locks belong to the open file
        description, so two threads of one process exclude each other as two processes do.
        """
        if getattr(self._local, "held", False):
            yield
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise KeystoreError(f"cannot lock key ring {self.path}: {exc.strerror}") from None
        try:
            self._acquire(fd)
            self._local.held = True
            try:
                yield
            finally:
                self._local.held = False
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _acquire(self, fd: int) -> None:
        """`flock` with a deadline: poll a non-blocking lock for `lock_timeout` seconds
        (``MRTR_KEYS_LOCK_TIMEOUT``, default 30), so a stuck writer never hangs a deploy step."""
        timeout = self.lock_timeout
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KeystoreBusy(
                        f"key ring {self.path} is locked by another run (waited {timeout:g} s); "
                        "nothing was changed, retry later"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.2)

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
