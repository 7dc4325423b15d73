"""A local advisory lock file with a deadline, re-entrant within one thread.

Keystores hold it around read-modify-write sequences so cooperating writers on one host queue
instead of racing (compare-and-swap still decides between hosts). `flock` locks belong to the
open file description and each acquisition opens its own descriptor, so two threads of one
process exclude each other as two processes do. A writer gives up after the lock timeout
(``MRTR_KEYS_LOCK_TIMEOUT``, default 30 s) with `KeystoreBusy` (exit 75), so a stuck run never
hangs a deploy step.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from mrtr_keys.errors import ConfigError, KeystoreBusy, KeystoreError

ENV_LOCK_TIMEOUT = "MRTR_KEYS_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 30.0
"""Seconds a writer waits for another run's lock before giving up (exit 75)."""


def lock_timeout_from_env(value: float | None = None) -> float:
    """`value`, else ``MRTR_KEYS_LOCK_TIMEOUT``, else 30 (seconds, 0 to 3600).

    Raises:
        ConfigError: not a number, or out of range.
    """
    if value is None:
        try:
            value = float(os.environ.get(ENV_LOCK_TIMEOUT, DEFAULT_LOCK_TIMEOUT))
        except ValueError:
            raise ConfigError(f"{ENV_LOCK_TIMEOUT} must be a number of seconds") from None
    if not 0 <= value <= 3600:
        raise ConfigError("the key ring lock timeout must be between 0 and 3600 seconds")
    return value


class LocalLock:
    """An exclusive `flock` on `path` (created 0600), taken by `held()`.

    Args:
        path: the lock file; its directory is created (0700) if missing.
        subject: how messages name what is locked (``key ring /x/keyring.json``).
        timeout: seconds to wait (see `lock_timeout_from_env`).
    """

    def __init__(self, path: Path, *, subject: str, timeout: float) -> None:
        self.path = path
        self.subject = subject
        self.timeout = timeout
        self._local = threading.local()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock (re-entrant per thread).

        Raises:
            KeystoreBusy: another run held it for longer than the timeout.
            KeystoreError: the lock file cannot be created.
        """
        if getattr(self._local, "held", False):
            yield
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise KeystoreError(f"cannot lock {self.subject}: {exc.strerror}") from None
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
        deadline = time.monotonic() + self.timeout
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KeystoreBusy(
                        f"{self.subject} is locked by another run (waited {self.timeout:g} s); "
                        "nothing was changed, retry later"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
