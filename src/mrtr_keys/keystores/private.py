"""Reading a private file (a key ring, a client registry) with the mode checks ssh applies to a private key.

Two cases, decided by the file's directory:

* **a directory this process can write** (the usual case): the file is opened without following
  a symlink (``O_NOFOLLOW``) and refused if group or others have any permission bit
  (``fix with: chmod 600``);
* **a read-only mount** (`is_read_only_mount`: a Kubernetes Secret or ConfigMap volume, whose
  kubelet-managed ``..data`` link is swapped atomically on update, or any directory this process
  cannot write): symlinks are followed as long as they stay inside the mount (the kubelet's
  ``keyring.json -> ..data/keyring.json``), and group *read* is accepted, because the kubelet
  writes Secret files as ``root:fsGroup`` with ``defaultMode`` (0440 for a non-root reader) and
  nobody can ``chmod`` them there. Group write and every bit for others are still refused: a
  world-readable key ring is an exposure wherever it is.

Whatever the directory, the path is examined (``stat``) before it is opened and anything but a regular
file (a FIFO, a device such as ``/dev/zero``, a directory, a socket) is refused in one line without
opening it; the open itself is non-blocking (``O_NONBLOCK``), and what was opened is checked again (it
may have been replaced in between). So a read never waits on a FIFO with no writer or a device that
never ends: the ring watcher that calls this cannot wedge on what sits at the ring's path (issue 22).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from mrtr_keys.errors import KeystoreError
from mrtr_keys.keystores.state import writable_dir

KUBELET_DATA_LINK = "..data"
"""The symlink the kubelet's atomic writer swaps to publish a new version of a Secret volume."""


def is_read_only_mount(directory: Path) -> bool:
    """True for a kubelet-managed volume (it has a ``..data`` link) or a directory this process cannot write."""
    return os.path.islink(directory / KUBELET_DATA_LINK) or (directory.is_dir() and not writable_dir(directory))


def file_kind(mode: int) -> str:
    """What a ``st_mode`` names, for messages: ``regular file``, ``FIFO``, ``directory``, ..."""
    for test, name in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISLNK, "symlink"),
    ):
        if test(mode):
            return name
    return "special file"


def _not_regular(what: str, path: Path, mode: int) -> KeystoreError:
    return KeystoreError(f"{what} {path} is a {file_kind(mode)}, not a regular file; refusing to read it")


def read_private_file(path: Path, what: str, *, max_bytes: int, missing: Exception | None = None) -> bytes:
    """The bytes of the file at `path`, after the checks in the module docstring.

    Args:
        what: how messages name the file (``key ring``, ``client registry``).
        max_bytes: larger files are refused.
        missing: raised when the file does not exist (default: a `KeystoreError`).

    Raises:
        KeystoreError: unreadable, not a regular file (FIFO, device, directory, socket), a symlink
            (off a mount) or one leaving the mount, a mode open to others (or to the group, off a
            mount), or too large. Never blocks on what the path names (see the module docstring).
    """
    directory = path.parent
    mounted = is_read_only_mount(directory)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if mounted and os.path.islink(path):
        real_dir = os.path.realpath(directory)
        if os.path.commonpath([real_dir, os.path.realpath(path)]) != real_dir:
            raise KeystoreError(f"{what} {path} is a symlink that leaves its mount {directory}")
    if not mounted:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        seen = os.stat(path) if mounted else os.lstat(path)
    except FileNotFoundError:
        raise (missing or KeystoreError(f"no {what} at {path}")) from None
    except OSError as exc:
        raise KeystoreError(f"cannot examine {what} {path}: {exc.strerror}") from None
    if stat.S_ISLNK(seen.st_mode):
        raise KeystoreError(f"{what} {path} is a symlink; refusing to follow it (point the keystore at the file)")
    if not stat.S_ISREG(seen.st_mode):
        raise _not_regular(what, path, seen.st_mode)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise (missing or KeystoreError(f"no {what} at {path}")) from None
    except OSError as exc:
        raise KeystoreError(f"cannot open {what} {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced between the look and the (non-blocking) open
        os.close(fd)
        raise _not_regular(what, path, st.st_mode)
    with os.fdopen(fd, "rb") as f:
        mode = stat.S_IMODE(st.st_mode)
        if mounted and mode & (stat.S_IRWXO | stat.S_IWGRP | stat.S_IXGRP):
            raise KeystoreError(
                f"{what} {path} on a read-only mount is open to others or group-writable (mode {mode:04o}); "
                "publish it as 0440 or 0400 (Kubernetes: defaultMode: 0440 on the Secret volume)"
            )
        if not mounted and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeystoreError(
                f"{what} {path} is accessible by group or others (mode {mode:04o}); fix with: chmod 600 {path}"
            )
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise KeystoreError(f"cannot read {what} {path}: {exc.strerror}") from None
    if len(data) > max_bytes:
        raise KeystoreError(f"{what} {path} is larger than {max_bytes} bytes")
    return data
