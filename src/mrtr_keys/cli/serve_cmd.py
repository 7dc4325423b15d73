"""`mrtr-keys serve`: run the sealing sidecar (see docs/sidecar.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from mrtr_keys.cli.options import KeystoreOpt


def serve(
    keystore_: KeystoreOpt = None,
    host: Annotated[str | None, typer.Option("--host", help="Listen address [default: 127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option("--port", help="TCP port [default: 8750].")] = None,
    uds: Annotated[
        str | None, typer.Option("--uds", help="Listen on this Unix socket (created mode 0600) instead of TCP.")
    ] = None,
    workers: Annotated[int | None, typer.Option("--workers", help="Worker processes [default: 1].")] = None,
    reload_interval: Annotated[
        float | None,
        typer.Option("--reload-interval", help="Seconds between key ring / client registry polls [default: 2]."),
    ] = None,
    config: Annotated[str | None, typer.Option("--config", help="TOML file with a [sidecar] table.")] = None,
    clients: Annotated[
        str | None,
        typer.Option("--clients", envvar="MRTR_KEYS_CLIENTS", help="Client registry file [default: beside the ring]."),
    ] = None,
) -> None:
    """Serve seal/unseal over HTTP for many MCP servers; picks up rotations and new clients without a restart."""
    from mrtr_keys.service.config import load_config
    from mrtr_keys.service.server import serve as run_server

    settings = load_config(config).with_overrides(
        keystore=keystore_,
        clients=clients,
        host=host,
        port=port,
        uds=uds,
        workers=workers,
        reload_interval=reload_interval,
    )
    run_server(settings)
