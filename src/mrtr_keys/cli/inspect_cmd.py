"""`mrtr-keys inspect TOKEN`: format, kid, kid state and sizes; `--decrypt` adds the envelope claims.

``inspect -`` reads the token from standard input, so it stays out of the shell history.
"""

from __future__ import annotations

from typing import Annotated

import typer

from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, keystore
from mrtr_keys.errors import ConfigError


def inspect(
    token: Annotated[str, typer.Argument(help="The requestState token, or - to read it from standard input.")],
    keystore_: KeystoreOpt = None,
    decrypt: Annotated[bool, typer.Option("--decrypt", help="Unseal and show the SDK envelope claims.")] = False,
    audience: Annotated[str | None, typer.Option("--audience", help="Audience to unseal for.")] = None,
    show_state: Annotated[bool, typer.Option("--show-state", help="Also show the inner state 's'.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Describe a token without decrypting it (or with --decrypt --audience A)."""
    from mrtr_keys.cli.output import print_fields, print_json
    from mrtr_keys.inspection import inspect_token

    if token == "-":  # noqa: S105 - the stdin marker, not a secret
        token = _read_stdin()
    info = inspect_token(keystore(keystore_), token, decrypt=decrypt, audience=audience, show_state=show_state)
    if json_:
        print_json(info)
    else:
        print_fields("token", info)


STDIN_SLACK = 4096
"""Characters of whitespace around the token that ``inspect -`` reads beyond `MAX_TOKEN_CHARS`."""


def _read_stdin() -> str:
    """The token from standard input: surrounding whitespace dropped, one token only.

    Reads up to `mrtr_keys.token.MAX_TOKEN_CHARS` (the longest token a codec accepts) plus `STDIN_SLACK`, so
    every token `seal` returns is read whole; more is refused rather than cut (a cut token is another token).

    Raises:
        ConfigError: nothing, more than one word, or more than any token on standard input.
    """
    import sys

    from mrtr_keys.token import MAX_TOKEN_CHARS

    limit = MAX_TOKEN_CHARS + STDIN_SLACK
    text = sys.stdin.read(limit + 1)
    if len(text) > limit:
        raise ConfigError(
            f"inspect -: standard input holds more than {limit:,} characters, longer than any token "
            f"({MAX_TOKEN_CHARS:,} characters at most)"
        )
    words = text.split()
    if len(words) != 1:
        raise ConfigError("inspect -: standard input must hold exactly one token")
    return words[0]
