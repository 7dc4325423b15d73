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
        help="Key ring path or file:// URL [default: .mrtr/keyring.json].",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for machines instead of a table.")]


def keystore(location: str | None):  # type: ignore[no-untyped-def]
    """Open the keystore named by --keystore / MRTR_KEYS_KEYSTORE / the default."""
    from mrtr_keys.keystores import open_keystore

    return open_keystore(location)
