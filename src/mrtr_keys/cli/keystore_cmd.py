"""`mrtr-keys keystore copy SRC DST`: move a key ring between keystores (see `mrtr_keys.keystores.copy`)."""

from __future__ import annotations

from typing import Annotated

import typer

from mrtr_keys.cli.options import JsonOpt, root_state_dir

app = typer.Typer(help="Key ring storage: copy a ring between keystores.", no_args_is_help=True)


@app.command("copy")
def copy(
    source: Annotated[str, typer.Argument(help="Keystore to read: a path, file://, vault-kv:// or aws-sm:// URL.")],
    destination: Annotated[str, typer.Argument(help="Keystore to write (created, or an older generation).")],
    json_: JsonOpt = False,
) -> None:
    """Copy the ring (same ring_id and generation); refuses to overwrite a newer ring or another ring."""
    from mrtr_keys.cli.output import print_json, print_line
    from mrtr_keys.keystores import open_keystore
    from mrtr_keys.keystores.copy import copy_ring

    result = copy_ring(
        open_keystore(source, state_dir=root_state_dir()), open_keystore(destination, state_dir=root_state_dir())
    )
    if json_:
        print_json(result.describe())
        return
    ring = result.ring
    if not result.changed:
        print_line(f"{result.destination} already holds generation {ring.generation} of {ring.ring_id}; nothing copied")
        return
    over = f" (replacing generation {result.replaced_generation})" if result.replaced_generation else ""
    print_line(f"copied key ring {ring.ring_id} generation {ring.generation} to {result.destination}{over}")
    for key in ring.keys:
        print_line(f"  {key.kid}  {key.state.value}")
