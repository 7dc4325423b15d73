"""`mrtr-keys rewrap --kms-key-id ARN`: re-wrap a KMS ring's data keys under another KMS key."""

from __future__ import annotations

from typing import Annotated

import typer

from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, change_listeners, keystore


def rewrap(
    kms_key_id: Annotated[
        str, typer.Option("--kms-key-id", help="The KMS key to re-wrap under (ARN, key id or alias).")
    ],
    keystore_: KeystoreOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Re-encrypt every usable data key under another KMS key (ReEncrypt); kids and tokens stay valid."""
    from mrtr_keys.changes.rewrap import rewrap as run_rewrap
    from mrtr_keys.cli.output import print_change

    result = run_rewrap(keystore(keystore_), kms_key_id, listeners=change_listeners())
    print_change(result, json_)
