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


def read_private_file(path: Path, what: str, *, max_bytes: int, missing: Exception | None = None) -> bytes:
    """The bytes of the file at `path`, after the checks in the module docstring.

    Args:
        what: how messages name the file (``key ring``, ``client registry``).
        max_bytes: larger files are refused.
        missing: raised when the file does not exist (default: a `KeystoreError`).

    Raises:
        KeystoreError: unreadable, not a regular file, a symlink (off a mount) or one leaving the
            mount, a mode open to others (or to the group, off a mount), or too large.
    """
    directory = path.parent
    mounted = is_read_only_mount(directory)
    flags = os.O_RDONLY | (0 if mounted else getattr(os, "O_NOFOLLOW", 0))
    if mounted and os.path.islink(path):
        real_dir = os.path.realpath(directory)
        if os.path.commonpath([real_dir, os.path.realpath(path)]) != real_dir:
            raise KeystoreError(f"{what} {path} is a symlink that leaves its mount {directory}")
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise (missing or KeystoreError(f"no {what} at {path}")) from None
    except OSError as exc:
        raise KeystoreError(f"cannot open {what} {path}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise KeystoreError(f"{what} {path} is not a regular file")
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
