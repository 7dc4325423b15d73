"""`mrtr-keys clients add|list|remove`: who may seal or unseal through the sidecar, for which audiences."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, root_state_dir
from mrtr_keys.errors import ConfigError

app = typer.Typer(help="Sidecar clients: names, audiences, operations (secrets are shown once).", no_args_is_help=True)

ClientsOpt = Annotated[
    str | None,
    typer.Option(
        "--clients",
        envvar="MRTR_KEYS_CLIENTS",
        help="Client registry file [default: clients.json in the state directory].",
        show_default=False,
    ),
]


def _path(keystore_: str | None, clients: str | None) -> Path:
    from mrtr_keys.service.clients import registry_path

    if clients:
        return registry_path(None, clients)
    from mrtr_keys.keystores import open_keystore

    return registry_path(open_keystore(keystore_, state_dir=root_state_dir()).directory)


@app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="Client name (A-Z a-z 0-9 . _ -).")],
    audience: Annotated[list[str], typer.Option("--audience", help="Audience it may use (repeat).")],
    ops: Annotated[str, typer.Option("--ops", help="Operations: seal, unseal or seal,unseal.")] = "seal,unseal",
    keystore_: KeystoreOpt = None,
    clients: ClientsOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Register a client and print its bearer secret, once (only its hash is stored)."""
    from mrtr_keys.cli.output import print_json, print_line
    from mrtr_keys.keystores import open_keystore
    from mrtr_keys.service.clients import add_client

    store = open_keystore(keystore_, state_dir=root_state_dir())
    if not store.exists():  # a registry beside no ring is one no sidecar reads (docs/sidecar.md)
        raise ConfigError(
            f"no key ring at {store.url}: a sidecar serves clients of the ring it loads, so add clients where "
            "that ring is: pass --keystore (or set MRTR_KEYS_KEYSTORE), or create one first with: mrtr-keys init"
        )
    for a in audience:  # a grant the ring can never serve is a mistake worth catching now
        store.load().check_audience(a)
    client, secret = add_client(_path(keystore_, clients), name, audiences=audience, ops=[ops])
    if json_:
        print_json({"client": client.describe(), "secret": secret})
        return
    print_line(
        f"client {client.name} added (audiences: {', '.join(sorted(client.audiences))}; "
        f"ops: {', '.join(sorted(client.ops))})"
    )
    print_line(f"secret (shown once, store it now): {secret}")


@app.command("list")
def list_(keystore_: KeystoreOpt = None, clients: ClientsOpt = None, json_: JsonOpt = False) -> None:
    """List clients: name, audiences, operations, created (never a secret or its hash)."""
    from mrtr_keys.cli.output import print_json, print_line, print_table
    from mrtr_keys.service.clients import load_registry

    path = _path(keystore_, clients)
    rows = [c.describe() for c in load_registry(path)]
    if json_:
        print_json({"clients": rows})
        return
    if not rows:
        print_line(f"no sidecar clients in {path}; add one with: mrtr-keys clients add NAME --audience AUDIENCE")
        return
    print_table(
        "sidecar clients",
        ["name", "audiences", "ops", "created_at"],
        [[r["name"], ", ".join(r["audiences"]), ",".join(r["ops"]), r["created_at"]] for r in rows],
    )


@app.command("remove")
def remove(
    name: Annotated[str, typer.Argument(help="Client name.")],
    keystore_: KeystoreOpt = None,
    clients: ClientsOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Remove a client; a running sidecar refuses its secret within one reload interval."""
    from mrtr_keys.cli.output import print_json, print_line
    from mrtr_keys.service.clients import remove_client

    client = remove_client(_path(keystore_, clients), name)
    if json_:
        print_json({"removed": client.name})
    else:
        print_line(f"client {client.name} removed")
