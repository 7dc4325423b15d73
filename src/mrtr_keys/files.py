"""Reading a small file a user names (a backup, a config file, a key file): never blocking, never unbounded.

A path given on a command line or in a config may name a FIFO (the open of which blocks until a writer
comes) or a device such as ``/dev/zero`` (read until memory runs out). `read_small_file` opens without
blocking (``O_NONBLOCK``, open(2)), refuses anything but a regular file, and reads at most one byte more
than the caller allows, so the caller can say "too large" in its own words.
"""

from __future__ import annotations

import os
import stat

from mrtr_keys.errors import ConfigError


def read_small_file(path: str | os.PathLike[str], what: str, max_bytes: int, *, not_regular: str = "") -> bytes:
    """At most ``max_bytes + 1`` bytes of the regular file at `path` (more than `max_bytes` returned means
    the file is larger: the caller refuses it with its own message).

    Args:
        path: the file, as the user gave it (symbolic links followed).
        what: how messages name it (``backup``, ``config file``, ``the key file``).
        max_bytes: the most the caller accepts (bytes).
        not_regular: appended to the "not a regular file" message (a hint, with its leading space).

    Raises:
        ConfigError: ``cannot read {what} {path}: {why}``, one line: it cannot be opened or read (the
            system's reason), or it is not a regular file (a FIFO, device, directory or socket).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or type(exc).__name__}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # checked before fdopen, which refuses a directory itself
            raise ConfigError(f"cannot read {what} {path}: not a regular file{not_regular}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or type(exc).__name__}") from None
    finally:
        os.close(fd)
