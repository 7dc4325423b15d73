"""Reading a small file a user names (a backup, a config file, a key file): never blocking, never unbounded.

A path given on a command line or in a config may name a FIFO (the open of which blocks until a writer
comes) or a device such as ``/dev/zero`` (read until memory runs out). `read_small_file` opens without
blocking (``O_NONBLOCK``, open(2)), refuses anything but a regular file, and reads at most one byte more
than the caller allows, so the caller can say "too large" in its own words. `read_regular` is the same read
for callers that judge the file's stat themselves (a key file's mode) and word their own errors.
"""

from __future__ import annotations

import os
import stat

from mrtr_keys.errors import ConfigError


def read_regular(
    path: str | os.PathLike[str], max_bytes: int, *, follow: bool = True
) -> tuple[os.stat_result, bytes | None]:
    """The file's stat and at most ``max_bytes + 1`` of its bytes, or None for the bytes when it is not a
    regular file (a FIFO, device, directory or socket: opened without blocking, read not at all).

    Args:
        path: the file.
        max_bytes: the most the caller accepts (bytes); one more is read so it can tell "too large".
        follow: False to refuse a symbolic link (``O_NOFOLLOW``, open(2)).

    Raises:
        OSError: it cannot be opened or read (with `follow` False, also when it is a symbolic link).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else getattr(os, "O_NOFOLLOW", 0))
    fd = os.open(path, flags)  # O_NONBLOCK: a FIFO must not block the open
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # checked before fdopen, which refuses a directory itself
            return info, None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return info, f.read(max_bytes + 1)
    finally:
        os.close(fd)


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
        _, data = read_regular(path, max_bytes)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or type(exc).__name__}") from None
    if data is None:
        raise ConfigError(f"cannot read {what} {path}: not a regular file{not_regular}")
    return data
