"""`mrtr-keys keys list`: kids, states and times (never material)."""

from __future__ import annotations

import typer

from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, keystore

app = typer.Typer(help="Show the key ring's keys.", no_args_is_help=True)


@app.command("list")
def list_keys(keystore_: KeystoreOpt = None, json_: JsonOpt = False) -> None:
    """List keys: kid, state, created / promoted / demoted / retired (UTC)."""
    from mrtr_keys.cli.output import print_json, print_table

    ring = keystore(keystore_).load()
    rows = [k.describe() for k in ring.keys]
    if json_:
        print_json({"ring_id": ring.ring_id, "generation": ring.generation, "codec": ring.codec.type, "keys": rows})
        return
    cols = ["kid", "state", "created_at", "promoted_at", "demoted_at", "retired_at"]
    print_table(
        f"key ring {ring.ring_id} (generation {ring.generation}, codec {ring.codec.type})",
        cols,
        [[r[c] for c in cols] for r in rows],
    )
