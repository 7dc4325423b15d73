"""Options shared by every command (declared once, reused as `Annotated` types)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from mrtr_keys.changes.apply import ChangeListener

KeystoreOpt = Annotated[
    str | None,
    typer.Option(
        "--keystore",
        "-k",
        envvar="MRTR_KEYS_KEYSTORE",
        help="Key ring: a path, file:///PATH, vault-kv://MOUNT/PATH or aws-sm://NAME [default: .mrtr/keyring.json].",
        show_default=False,
    ),
]
StateDirOpt = Annotated[
    str | None,
    typer.Option(
        "--state-dir",
        envvar="MRTR_KEYS_STATE_DIR",
        help="Directory for the audit key, default audit log, client registry and lock files "
        "[default: beside a writable ring file, else a per-user directory].",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for machines instead of a table.")]
KeyFormatOpt = Annotated[
    str | None,
    typer.Option(
        "--key-format",
        help="Format of the new key: mk2 (AES-256-GCM-SIV, 2^48 seals a key) or mk1 (AES-256-GCM, 2^32; read by "
        "releases before 0.2.0) [default: mk2 where the codec seals it; docs/token-format.md].",
        show_default=False,
    ),
]


def keystore(location: str | None):  # type: ignore[no-untyped-def]
    """Open the keystore named by --keystore / MRTR_KEYS_KEYSTORE / the default."""
    from mrtr_keys.keystores import open_keystore

    return open_keystore(location, state_dir=root_state_dir())


_root: dict[str, str | None] = {"audit": None, "log_format": None, "state_dir": None}
"""The root command's ``--audit``, ``--state-dir`` and chosen log format for this run (the CLI's only state; passed on
explicitly, never put in the environment)."""


def set_root(*, audit: str | None, log_format: str | None, state_dir: str | None = None) -> None:
    """Remember the root ``--audit URL`` (or ``MRTR_KEYS_AUDIT``), ``--log-format`` (or ``MRTR_KEYS_LOG_FORMAT``)
    and ``--state-dir`` (or ``MRTR_KEYS_STATE_DIR``)."""
    _root.update(audit=audit, log_format=log_format, state_dir=state_dir)


def root_state_dir() -> str | None:
    """The root ``--state-dir`` / ``MRTR_KEYS_STATE_DIR`` of this run (an absolute path), or None."""
    return _root["state_dir"]


def root_audit() -> str | None:
    """The root ``--audit`` value of this run, or None (then the library's default applies)."""
    return _root["audit"]


def root_log_format() -> str | None:
    """The root ``--log-format`` / ``MRTR_KEYS_LOG_FORMAT`` value of this run, or None when neither is given."""
    return _root["log_format"]


def change_listeners() -> tuple[ChangeListener, ...]:
    """What every ring-changing command passes as ``listeners=``: the audit log's change recorder."""
    from mrtr_keys.audit.ring_changes import change_listener

    return (change_listener(root_audit()),)
