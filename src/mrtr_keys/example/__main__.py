"""`python -m mrtr_keys.example`: serve the example MCP server over streamable HTTP with uvicorn.

    python -m mrtr_keys.example --keystore PATH --audience NAME --host 127.0.0.1 --port N
        [--codec-from-ring | --sdk-default-key | --sidecar URL | --sdk-key-file PATH] [--instance NAME]
        [--ttl SECONDS] [--reload-every SECONDS] [--heartbeat-every SECONDS] [--lease SECONDS]
        [--max-fenced-out SECONDS] [--kek-check-every SECONDS] [--create-ring]

Key sources (mutually exclusive):
  --codec-from-ring (default)  ``mrtr_keys.request_state_security(keystore, audience=NAME)``: the codec the
                               key ring records (local, KMS, Vault transit), shared by every process
                               opening the same ring.
  --sdk-default-key            the MCP SDK's default: a key generated at process start, so a retry that
                               reaches another process is rejected (the negative fleet test uses it).
  --sidecar URL                seal through a sealing sidecar (secret from MRTR_KEYS_SIDECAR_SECRET).
  --sdk-key-file PATH          the MCP SDK's own codec with a shared key: ``RequestStateSecurity(keys=[KEY])``,
                               KEY being the file's bytes; a fleet before it adopts mrtr-keys (docs/migration.md).

It prints the URL and a command that calls the tool, then serves until SIGINT/SIGTERM.
Exit codes: 0 stopped, 2 configuration error (no key ring, audience outside the ring's scope, bad TTL),
1 anything else (e.g. the port is taken).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
from collections.abc import Sequence
from typing import Any

from mcp.server.mcpserver import RequestStateSecurity

from mrtr_keys.errors import ConfigError, KeyRingExists, MrtrKeysError
from mrtr_keys.example.app import DEFAULT_NAME, build_server

PROG = "python -m mrtr_keys.example"
MCP_PATH = "/mcp"
logger = logging.getLogger("mrtr_keys.example")


def _port(text: str) -> int:
    """A TCP port, 1 to 65535 (uvicorn took 99999 as 34463, modulo 2^16, and printed the URL with 99999)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 65535, not {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be from 1 to 65535, not {port}")
    return port


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Example MCP server whose tool asks a question; requestState sealed by mrtr-keys."
    )
    parser.add_argument(
        "--keystore",
        default=None,
        help="key ring path or file:// URL (default: $MRTR_KEYS_KEYSTORE, else .mrtr/keyring.json)",
    )
    parser.add_argument(
        "--audience", default=DEFAULT_NAME, help=f"server name and requestState audience (default {DEFAULT_NAME})"
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="listen port, 1 to 65535 (default 8000)")
    parser.add_argument(
        "--instance",
        default="",
        help="instance name: shown in the tool's answer ('served by NAME') and in presence "
        "(default: $MRTR_KEYS_INSTANCE, else host:pid)",
    )
    parser.add_argument("--ttl", type=float, default=600.0, help="seconds a sealed round stays valid (default 600)")
    parser.add_argument(
        "--reload-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="check the key ring for a new generation this often (default 2; 0: never, which holds back rotations)",
    )
    parser.add_argument(
        "--heartbeat-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="write a presence heartbeat to the audit store this often (default 10)",
    )
    parser.add_argument(
        "--lease",
        type=float,
        default=None,
        metavar="SECONDS",
        help="self-fencing lease: check the key ring before serving once this long has passed since the last "
        "successful check (default 3 heartbeats; 0: off)",
    )
    parser.add_argument(
        "--max-fenced-out",
        type=float,
        default=None,
        metavar="SECONDS",
        help="refuse to seal and unseal once served this long fenced out (keystore unreachable past the lease; "
        "default: no cap)",
    )
    parser.add_argument(
        "--kek-check-every",
        type=float,
        default=None,
        metavar="SECONDS",
        help="check a KMS / Vault data-key ring's wrapping key this often (default $MRTR_KEYS_KEK_CHECK_EVERY, "
        "else 300; 0: off)",
    )
    parser.add_argument(
        "--create-ring", action="store_true", help="create a local key ring at --keystore if none exists there"
    )
    add_key_source_options(parser)
    return parser


def add_key_source_options(parser: argparse.ArgumentParser) -> None:
    """The mutually exclusive key-source flags; `args.key_source` names the one chosen.

    Seam for new key sources: add the flag here (e.g. ``--sidecar URL`` with ``--secret S``, setting
    ``key_source="sidecar"``) and pass its values on in `request_state_options`.
    """
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--codec-from-ring",
        dest="key_source",
        action="store_const",
        const="ring",
        help="seal with the codec the key ring records (default)",
    )
    source.add_argument(
        "--sdk-default-key",
        dest="key_source",
        action="store_const",
        const="sdk-default",
        help="seal with the MCP SDK's per-process ephemeral key (retries on another process are rejected)",
    )
    source.add_argument(
        "--sidecar",
        metavar="URL",
        help="seal through a sealing sidecar (http://HOST:PORT or unix:///PATH); the client secret comes from "
        "MRTR_KEYS_SIDECAR_SECRET",
    )
    source.add_argument(
        "--sdk-key-file",
        metavar="PATH",
        help="seal with the MCP SDK's own codec, RequestStateSecurity(keys=[the file's bytes]) (no mrtr-keys)",
    )
    parser.set_defaults(key_source="ring")


def request_state_options(args: argparse.Namespace) -> dict[str, Any]:
    """Extra keyword arguments for `mrtr_keys.request_state_security` from the key-source flags.

    Empty for ``--codec-from-ring`` but for the watcher and presence options (``reload_every``,
    ``instance``, ``heartbeat_every``, ``lease``, ``max_fenced_out``, ``kek_check_every``); ``--sidecar URL``
    gives ``sidecar=URL``.
    """
    if getattr(args, "sidecar", None):
        return {"sidecar": args.sidecar}
    options: dict[str, Any] = {}
    if args.reload_every is not None:
        options["reload_every"] = args.reload_every
    if args.heartbeat_every is not None:
        options["heartbeat_every"] = args.heartbeat_every
    if args.lease is not None:
        options["lease"] = args.lease
    if args.max_fenced_out is not None:
        options["max_fenced_out"] = args.max_fenced_out
    if args.kek_check_every is not None:
        options["kek_check_every"] = args.kek_check_every
    if args.instance:
        options["instance"] = args.instance
    return options


def security_from_args(args: argparse.Namespace) -> RequestStateSecurity | None:
    """The `RequestStateSecurity` the flags ask for; None means the SDK's default ephemeral key.

    Raises:
        MrtrKeysError: the key ring is missing or unusable, or the audience is outside its scope.
    """
    if args.key_source == "sdk-default":
        return None
    if args.sdk_key_file is not None:
        from mrtr_keys.files import read_small_file
        from mrtr_keys.ring.sdk_keys import MAX_KEY_FILE_BYTES

        key = read_small_file(args.sdk_key_file, "--sdk-key-file", MAX_KEY_FILE_BYTES)  # a FIFO: one line, no hang
        if len(key) > MAX_KEY_FILE_BYTES:
            raise ConfigError(
                f"--sdk-key-file {args.sdk_key_file} is over {MAX_KEY_FILE_BYTES} bytes; it is not a key file"
            )
        try:
            return RequestStateSecurity(keys=[key], ttl=args.ttl)
        except ValueError:
            raise ConfigError("--sdk-key-file: the MCP SDK needs a key of at least 32 bytes") from None
    from mrtr_keys.factory import request_state_security

    if args.create_ring:
        _create_ring_if_missing(args.keystore)
    return request_state_security(args.keystore, audience=args.audience, ttl=args.ttl, **request_state_options(args))


def _create_ring_if_missing(location: str | None) -> None:
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.keystores import open_keystore

    store = open_keystore(location)
    if store.exists():
        return
    try:
        result = create_ring(store)
    except KeyRingExists:  # another process created it first: use theirs
        return
    print(f"created key ring at {store.url}; primary key {result.ring.primary.kid}", flush=True)


def describe_security(security: RequestStateSecurity | None) -> str:
    """One line saying what seals requestState (never key material)."""
    if security is None:
        return "the MCP SDK's default key (made at process start; valid in this process only)"
    codec = security.codec
    ring = getattr(codec, "ring", None)
    if ring is None:
        return f"{type(codec).__name__}, audience {security.audience!r}, ttl {security.ttl:g} s"
    return (
        f"{ring.codec.type} codec, key ring {ring.ring_id} generation {ring.generation} "
        f"(primary key {ring.primary.kid}), audience {security.audience!r}, ttl {security.ttl:g} s"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(args: argparse.Namespace) -> None:
    """Build the server and run uvicorn until SIGINT/SIGTERM.

    Raises:
        MrtrKeysError: see `security_from_args`.
    """
    import uvicorn

    from mrtr_keys.hardening import core_dumps_allowed, harden_process

    hardening = harden_process()  # before the ring's keys are read (MRTR_KEYS_ALLOW_CORE_DUMPS=1: not)
    if not hardening.hardened and not core_dumps_allowed():  # not Linux, or refused: one line
        print(f"warning: {hardening.note}", file=sys.stderr, flush=True)
    security = security_from_args(args)
    # One plain line per record (the SDK's rich handler would wrap them); set before MCPServer's own setup.
    logging.basicConfig(level=logging.INFO, format="%(levelname)-8s %(name)s: %(message)s", stream=sys.stderr)
    mcp = build_server(security, name=args.audience, instance=args.instance)
    url = f"http://{args.host}:{args.port}{MCP_PATH}"
    print(f"mrtr-keys example MCP server {args.audience!r}" + (f" (instance {args.instance})" if args.instance else ""))
    print(f"  URL:          {url}")
    print(f"  requestState: sealed by {describe_security(security)}")
    print(f"  call it:      python -m mrtr_keys.example.client {url} --name orders --region eu-west-1", flush=True)
    if not _is_loopback(args.host):
        print("warning: listening on a non-loopback address; this example has no authentication", flush=True)
    app = mcp.streamable_http_app(streamable_http_path=MCP_PATH, json_response=True, host=args.host)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=False)
    uvicorn.Server(config).run()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (errors are one line on stderr, never a traceback)."""
    args = build_parser().parse_args(argv)
    try:
        serve(args)
    except MrtrKeysError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
