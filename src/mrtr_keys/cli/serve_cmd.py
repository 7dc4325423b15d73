"""`mrtr-keys serve`: run the sealing sidecar (see docs/sidecar.md)."""

from __future__ import annotations

from typing import Annotated

import typer

from mrtr_keys.cli.options import KeystoreOpt, root_audit, root_log_format, root_state_dir
from mrtr_keys.errors import ConfigError


def serve(
    keystore_: KeystoreOpt = None,
    host: Annotated[
        str | None, typer.Option("--host", envvar="MRTR_KEYS_HOST", help="Listen address [default: 127.0.0.1].")
    ] = None,
    port: Annotated[
        int | None, typer.Option("--port", envvar="MRTR_KEYS_PORT", help="TCP port [default: 8750].")
    ] = None,
    uds: Annotated[
        str | None, typer.Option("--uds", help="Listen on this Unix socket (created mode 0600) instead of TCP.")
    ] = None,
    workers: Annotated[int | None, typer.Option("--workers", help="Worker processes [default: 1].")] = None,
    reload_interval: Annotated[
        float | None,
        typer.Option(
            "--reload-interval", help="Seconds between key ring and client registry checks; 0: off [default: 2]."
        ),
    ] = None,
    instance: Annotated[
        str | None,
        typer.Option(
            "--instance", envvar="MRTR_KEYS_INSTANCE", help="This instance's name in presence [default: host:pid]."
        ),
    ] = None,
    heartbeat_interval: Annotated[
        float | None,
        typer.Option("--heartbeat-interval", help="Seconds between presence heartbeats [default: 10]."),
    ] = None,
    lease: Annotated[
        float | None,
        typer.Option(
            "--lease",
            help="Self-fencing lease: check the key ring before serving once this many seconds have passed since "
            "the last successful check; 0: off [default: 3 heartbeat intervals].",
        ),
    ] = None,
    max_fenced_out: Annotated[
        str | None,
        typer.Option(
            "--max-fenced-out",
            metavar="DURATION",
            help="Answer 503 once the sidecar has served this long (90s, 10m) fenced out, i.e. without reaching the "
            "key ring past its lease: it cannot learn of a revocation then [default: off].",
        ),
    ] = None,
    kek_check_every: Annotated[
        float | None,
        typer.Option(
            "--kek-check-every",
            envvar="MRTR_KEYS_KEK_CHECK_EVERY",
            help="Seconds between checks of a KMS / Vault data-key ring's wrapping key; disabled or denied: fail "
            "closed; 0: off [default: 300].",
        ),
    ] = None,
    config: Annotated[str | None, typer.Option("--config", help="TOML file with a [sidecar] table.")] = None,
    clients: Annotated[
        str | None,
        typer.Option(
            "--clients", envvar="MRTR_KEYS_CLIENTS", help="Client registry [default: clients.json in the state dir]."
        ),
    ] = None,
    http: Annotated[
        str | None,
        typer.Option(
            "--http",
            envvar="MRTR_KEYS_HTTP",
            help="corked (one write per response) or httptools (uvicorn's own writes) [default: corked].",
        ),
    ] = None,
    max_connections_per_peer: Annotated[
        int | None,
        typer.Option(
            "--max-connections-per-peer",
            envvar="MRTR_KEYS_MAX_CONNECTIONS_PER_PEER",
            help="Connections one client address may hold open; beyond: 503 [default: 256].",
        ),
    ] = None,
    write_timeout: Annotated[
        float | None,
        typer.Option(
            "--write-timeout",
            help="Seconds a response write may make no progress before the connection is cut [default: 10].",
        ),
    ] = None,
    log_format: Annotated[
        str | None, typer.Option("--log-format", help="Log lines as text or json [default: text].")
    ] = None,
    replay_store: Annotated[
        str | None,
        typer.Option(
            "--replay-store",
            envvar="MRTR_KEYS_REPLAY_STORE",
            help="Single-use unseals: redis://HOST:PORT/DB or postgresql://... (docs/single-use.md); "
            "MRTR_KEYS_REPLAY_STORE keeps a password off the command line.",
        ),
    ] = None,
    single_use_client: Annotated[
        list[str] | None,
        typer.Option("--single-use-client", help="Only this client's unseals are single-use (repeatable)."),
    ] = None,
    single_use_audience: Annotated[
        list[str] | None,
        typer.Option("--single-use-audience", help="Only this audience's unseals are single-use (repeatable)."),
    ] = None,
    audit_retention: Annotated[
        str | None,
        typer.Option(
            "--audit-retention",
            help="Prune the audit log by itself, keeping this much (30d, 12w, 36h): a background run every "
            "--audit-retention-interval, cuts recorded in the checkpoint file as by `audit prune` [default: off].",
        ),
    ] = None,
    audit_retention_interval: Annotated[
        float | None,
        typer.Option("--audit-retention-interval", help="Seconds between retention runs [default: 3600]."),
    ] = None,
    audit_anchor: Annotated[
        str | None,
        typer.Option(
            "--audit-anchor",
            envvar="MRTR_KEYS_AUDIT_ANCHOR",
            help="Anchor the heads of the audit chains this sidecar writes, MACed with the chain key, every "
            "--audit-anchor-every seconds: a file, a directory or s3://BUCKET/PREFIX (Object Lock), a place the "
            "audit store's writers cannot rewrite; `audit verify --checkpoints DEST` reads it [default: off].",
        ),
    ] = None,
    audit_anchor_every: Annotated[
        float | None,
        typer.Option(
            "--audit-anchor-every",
            envvar="MRTR_KEYS_AUDIT_ANCHOR_EVERY",
            help="Seconds between anchors [default: 300].",
        ),
    ] = None,
    on_replay_store_error: Annotated[
        str | None,
        typer.Option("--on-replay-store-error", help="deny (refuse unseals while the store fails) or allow."),
    ] = None,
    expect_codec: Annotated[
        str | None,
        typer.Option(
            "--expect-codec",
            envvar="MRTR_KEYS_EXPECT_CODEC",
            help="Load only rings of this codec (local, kms, vault-transit): another one is refused at start "
            "(exit 2) and on reload (the last good ring stays). MRTR_KEYS_KMS_KEY_ID pins kms and its key.",
        ),
    ] = None,
    allow_core_dumps: Annotated[
        bool,
        typer.Option(
            "--allow-core-dumps",
            envvar="MRTR_KEYS_ALLOW_CORE_DUMPS",
            help="Debugging only: leave the sidecar and its children dumpable (a debugger or profiler of the "
            "same user can read their keys; a crash can write a core file). By default they are not.",
        ),
    ] = False,
) -> None:
    """Serve seal/unseal over HTTP for many MCP servers; picks up rotations and new clients without a restart."""
    from mrtr_keys.changes.lifecycle import parse_duration
    from mrtr_keys.logs import configure_logging
    from mrtr_keys.service.config import load_config

    chosen = log_format or root_log_format()
    if chosen is not None:
        chosen = configure_logging(chosen, force=True)
    from mrtr_keys.service.server import serve as run_server

    settings = load_config(config).with_overrides(
        keystore=keystore_,
        clients=clients,
        host=host,
        port=port,
        uds=uds,
        workers=workers,
        reload_interval=reload_interval,
        replay_store=replay_store,
        single_use_clients=tuple(single_use_client) if single_use_client else None,
        single_use_audiences=tuple(single_use_audience) if single_use_audience else None,
        on_replay_store_error=on_replay_store_error,
        http=http,
        max_connections_per_peer=max_connections_per_peer,
        write_timeout=write_timeout,
        audit=root_audit(),  # the root --audit / MRTR_KEYS_AUDIT, --state-dir and the log format, passed on
        state_dir=root_state_dir(),  # to the workers in their settings (never through the environment)
        log_format=chosen,
        instance=instance,
        heartbeat_interval=heartbeat_interval,
        lease=lease,
        max_fenced_out=None if max_fenced_out is None else parse_duration(max_fenced_out, "--max-fenced-out"),
        kek_check_every=kek_check_every,
        audit_retention=audit_retention,
        audit_retention_interval=audit_retention_interval,
        audit_anchor=audit_anchor or None,
        audit_anchor_every=audit_anchor_every,
        expect_codec=expect_codec,
        allow_core_dumps=allow_core_dumps or None,
    )
    if (settings.audit_retention or settings.audit_anchor) and settings.audit_factory is None:
        from mrtr_keys.audit.retention.loop import check_store
        from mrtr_keys.audit.writing.stores.url import resolve_url

        url = resolve_url(settings.audit, ".")  # "." stands for the ring's directory: its default is SQLite
        if settings.audit_retention:
            check_store(url)
        if settings.audit_anchor and url is None:
            raise ConfigError("audit_anchor needs an audit store, but auditing is off (--audit off)")
    if settings.uds is None:
        _check_listen_address(settings.host, settings.port)
    try:
        run_server(settings)
    except SystemExit as exc:  # uvicorn exits 3 when start-up fails; keep to 0 / 1 / 2 / 75
        code = exc.code if isinstance(exc.code, int) else 1
        raise SystemExit(code if code in (0, 1, 2, 75) else 1) from None


def _check_listen_address(host: str, port: int) -> None:
    """Refuse a TCP address that cannot be bound (one line, exit 2); warn when it is not loopback.

    Raises:
        ConfigError: the port is in use or the address is not this host's.
    """
    import ipaddress

    from mrtr_keys.cli.output import error
    from mrtr_keys.service.server import check_listen_address

    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        error(
            f"warning: listening on {host}, not loopback: bearer secrets and tokens cross the network in clear "
            "text unless a TLS proxy or a private network carries them (docs/sidecar.md)"
        )
    check_listen_address(host, port)
