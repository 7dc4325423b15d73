"""`mrtr-keys inspect TOKEN`: format, kid, kid state and sizes; `--decrypt` adds the envelope claims."""

from __future__ import annotations

from typing import Annotated

import typer

from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, keystore


def inspect(
    token: Annotated[str, typer.Argument(help="The requestState token.")],
    keystore_: KeystoreOpt = None,
    decrypt: Annotated[bool, typer.Option("--decrypt", help="Unseal and show the SDK envelope claims.")] = False,
    audience: Annotated[str | None, typer.Option("--audience", help="Audience to unseal for.")] = None,
    show_state: Annotated[bool, typer.Option("--show-state", help="Also show the inner state 's'.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Describe a token without decrypting it (or with --decrypt --audience A)."""
    from mrtr_keys.cli.output import print_fields, print_json
    from mrtr_keys.inspection import inspect_token

    info = inspect_token(keystore(keystore_), token, decrypt=decrypt, audience=audience, show_state=show_state)
    if json_:
        print_json(info)
    else:
        print_fields("token", info)
