"""A key ring on a read-only mount: a Kubernetes Secret volume (or any directory this process cannot write).

The kubelet publishes a Secret volume with its atomic writer (``k8s.io/kubernetes/pkg/volume/util``,
``AtomicWriter``): the files live in a timestamped directory ``..2026_12_01_13_02_55.123456789``,
the symlink ``..data`` points at it, and each visible name is a symlink through it
(``keyring.json -> ..data/keyring.json``). An update writes a new timestamped directory and renames
a new ``..data`` link over the old one, so a reader sees the old set of files or the new one,
never a mix. `revision()` is that link's target: one ``readlink`` per check, no file read, and it
changes exactly when the kubelet publishes. Without a ``..data`` link (a plain read-only
directory) it is the file's inode, size and modification time.

Files the kubelet writes for a non-root reader are ``root:fsGroup`` mode 0440; they are accepted
here (`mrtr_keys.keystores.private`), world-readable ones are not. Nothing is ever written: a
rotation runs against the keystore the Secret is made from, and the Secret is updated from it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from mrtr_keys.errors import ConfigError, KeyRingNotFound, KeystoreError
from mrtr_keys.keystores.file import MAX_RING_BYTES
from mrtr_keys.keystores.private import KUBELET_DATA_LINK, read_private_file
from mrtr_keys.keystores.state import configured_state_dir, ensure_dir, user_state_dir
from mrtr_keys.ring.document import parse_ring
from mrtr_keys.ring.model import KeyRing

WRITES_GO = (
    "writes go to the keystore the Secret is made from: run the command with --keystore set to it "
    "(a file, vault-kv:// or aws-sm://), then update the Secret from it (docs/keystores.md, 'Kubernetes Secret')"
)


class MountedKeystore:
    """A key ring file on a read-only mount. `create` and `save` always raise `KeystoreError`.

    Args:
        path: the ring's visible path on the mount (``/etc/mrtr/keyring.json``).
        state_dir: the state directory (default: ``MRTR_KEYS_STATE_DIR``, else a per-user directory;
            never the mount).
    """

    def __init__(self, path: str | os.PathLike[str], *, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path).expanduser().absolute()
        self.state_dir = state_dir

    def __repr__(self) -> str:
        return f"MountedKeystore({str(self.path)!r})"

    @property
    def url(self) -> str:
        return self.path.as_uri()

    @property
    def directory(self) -> Path:
        """The state directory: configured, else per user (`mrtr_keys.keystores.state`); never the mount."""
        configured = configured_state_dir(self.state_dir)
        if configured is None:
            return ensure_dir(user_state_dir(self.url))
        mount = self.path.parent.resolve()
        if configured.resolve() == mount or mount in configured.resolve().parents:
            raise ConfigError(
                f"state directory {configured} is on the read-only mount of key ring {self.path}; "
                "set --state-dir / MRTR_KEYS_STATE_DIR to a writable directory (an emptyDir in Kubernetes)"
            )
        return ensure_dir(configured)

    def exists(self) -> bool:
        return self.path.exists()

    def revision(self) -> str | None:
        """The ``..data`` link's target (or the file's inode, size, mtime, mode and owner); None when there is no ring.

        Raises:
            KeystoreError: the mount cannot be read.
        """
        link = self.path.parent / KUBELET_DATA_LINK
        try:
            if os.path.islink(link):
                return "data:" + os.readlink(link)
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise KeystoreError(f"cannot check key ring {self.path}: {exc.strerror}") from None
        return f"stat:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_mode:o}:{st.st_uid}:{st.st_gid}"

    def load(self) -> KeyRing:
        """Read the ring as the kubelet last published it.

        Raises:
            KeyRingNotFound, KeystoreError, KeyRingError.
        """
        missing = KeyRingNotFound(f"no key ring at {self.path} (is the Secret mounted with a keyring.json key?)")
        for attempt in range(3):
            try:
                data = read_private_file(self.path, "key ring", max_bytes=MAX_RING_BYTES, missing=missing)
            except KeyRingNotFound:
                # The kubelet removes the old timestamped directory right after the swap: a read that
                # resolved the old link can miss its file. The new one is there: read again.
                if attempt == 2 or not os.path.islink(self.path):
                    raise
                continue
            return parse_ring(data)
        raise missing  # pragma: no cover - the loop returns or raises

    def create(self, ring: KeyRing) -> None:
        raise KeystoreError(f"key ring {self.path} is on a read-only mount; nothing was written: {WRITES_GO}")

    def save(self, ring: KeyRing, *, expected_generation: int) -> None:
        raise KeystoreError(f"key ring {self.path} is on a read-only mount; nothing was written: {WRITES_GO}")

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Nothing to serialise: this keystore is never written."""
        yield
