"""`mrtr-keys audience list|add|remove`: the key ring's audience scope (exact, case-sensitive)."""

from __future__ import annotations

from typing import Annotated

import typer

from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, keystore

app = typer.Typer(help="The audiences the key ring may seal and unseal for.", no_args_is_help=True)
NameArg = Annotated[str, typer.Argument(help="Audience name (exact, case-sensitive).")]


@app.command("list")
def list_(keystore_: KeystoreOpt = None, json_: JsonOpt = False) -> None:
    """List the scope; empty means any audience."""
    from mrtr_keys.cli.output import print_json, print_line

    ring = keystore(keystore_).load()
    if json_:
        print_json({"audiences": list(ring.audiences), "any": not ring.audiences, "generation": ring.generation})
    elif not ring.audiences:
        print_line("(no audience scope: any audience)")
    else:
        for a in ring.audiences:
            print_line(a)


def _change(op: str, name: str, keystore_: str | None, json_: bool, *, allow_any: bool = False) -> None:
    from mrtr_keys.changes import scope as audience
    from mrtr_keys.cli.options import change_listeners
    from mrtr_keys.cli.output import print_json, print_line

    store = keystore(keystore_)
    if op == "add":
        result = audience.add(store, name, listeners=change_listeners())
    else:
        result = audience.remove(store, name, allow_any=allow_any, listeners=change_listeners())
    if json_:
        print_json(
            {
                "changed": result.changed,
                "audiences": list(result.ring.audiences),
                "generation": result.ring.generation,
                "message": result.message,
            }
        )
    else:
        print_line(result.message)


@app.command("add")
def add(name: NameArg, keystore_: KeystoreOpt = None, json_: JsonOpt = False) -> None:
    """Add an audience to the scope."""
    _change("add", name, keystore_, json_)


@app.command("remove")
def remove(
    name: NameArg,
    keystore_: KeystoreOpt = None,
    allow_any: Annotated[
        bool, typer.Option("--allow-any", help="Allow removing the last audience (an empty scope allows ANY).")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Remove an audience from the scope (the last one only with --allow-any)."""
    _change("remove", name, keystore_, json_, allow_any=allow_any)
