"""The state directory: where a process keeps its local files for one key ring.

What lives there: the audit key (``audit.key``), the default SQLite audit log (``audit.db``),
the sidecar's client registry (``clients.json``) unless ``--clients`` says otherwise, and the
lock files of keystores that need a local one. Never the key ring itself, and never a secret
that must be shared by the fleet.

Where it is, first match wins:

1. ``--state-dir`` / ``MRTR_KEYS_STATE_DIR`` (or `open_keystore(..., state_dir=...)`);
2. beside the ring, when the ring is a file in a directory this process can write (as before
   the state directory existed, so existing set-ups keep their audit log and registry);
3. a per-user directory: ``$XDG_STATE_HOME/mrtr-keys/<keystore>`` (default
   ``~/.local/state/mrtr-keys/<keystore>``, the XDG Base Directory Specification's place for
   state that should persist across restarts), one per keystore URL. A read-only mount (a
   Kubernetes Secret volume) and a remote keystore (Vault KV, Secrets Manager) always use it
   unless 1 applies.

A directory made here is created with mode 0700.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from mrtr_keys.errors import ConfigError

ENV_STATE_DIR = "MRTR_KEYS_STATE_DIR"


def _refuse_url(value: str) -> None:
    if "://" in value or "\x00" in value:
        raise ConfigError(
            f"the state directory is a local directory path, not {value!r} (--state-dir or {ENV_STATE_DIR})"
        )


def configured_state_dir(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """`explicit`, else ``MRTR_KEYS_STATE_DIR``, as an absolute path; None when neither is set.

    Raises:
        ConfigError: the value is a URL (``file:///x`` would become a directory named ``file:``) or
            holds a NUL byte.
    """
    value = str(explicit) if explicit is not None and str(explicit) else os.environ.get(ENV_STATE_DIR)
    if value:
        _refuse_url(value)
    return Path(value).expanduser().absolute() if value else None


def user_state_dir(keystore_url: str) -> Path:
    """The per-user state directory of the keystore at `keystore_url` (see the module docstring).

    The last part is the URL made file-name safe plus 8 hex characters of its SHA-256, so two
    keystores never share one and the name still says which ring it serves.

    Raises:
        ConfigError: no ``XDG_STATE_HOME`` and no home directory.
    """
    base = os.environ.get("XDG_STATE_HOME") or ""
    if base and Path(base).is_absolute():
        root = Path(base)
    else:
        try:
            root = Path.home() / ".local" / "state"
        except (RuntimeError, KeyError):  # no HOME and no passwd entry (a container's arbitrary uid)
            raise ConfigError(
                f"no home directory for a per-user state directory; set --state-dir or {ENV_STATE_DIR}"
            ) from None
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", keystore_url.split("://", 1)[-1]).strip("-.")[:60] or "keystore"
    digest = hashlib.sha256(keystore_url.encode("utf-8")).hexdigest()[:8]
    return root / "mrtr-keys" / f"{slug}-{digest}"


def ensure_dir(path: Path) -> Path:
    """Create `path` (mode 0700, parents as needed) if it is missing; returns it.

    Raises:
        ConfigError: it cannot be created (naming the path and how to choose another).
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create state directory {path}: {exc.strerror}; "
            f"choose a writable one with --state-dir or {ENV_STATE_DIR}"
        ) from None
    return path


def writable_dir(path: Path) -> bool:
    """True if this process may create files in `path` (an existing directory on a writable mount)."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return False
    except OSError:
        return False
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)
