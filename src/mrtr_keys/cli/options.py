"""Options shared by every command (declared once, reused as `Annotated` types)."""

from __future__ import annotations

from typing import Annotated

import typer

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


def keystore(location: str | None):  # type: ignore[no-untyped-def]
    """Open the keystore named by --keystore / MRTR_KEYS_KEYSTORE / the default."""
    from mrtr_keys.keystores import open_keystore

    return open_keystore(location)
