"""`make run` (``python -m mrtr_keys.run``): the sealing sidecar on embedded defaults, loopback only.

On first run it creates, under ``./.mrtr/``: a local key ring (``keyring.json``), the client
registry (``clients.json``) with one client, ``demo``, granted the audience ``demo``, and that
client's secret in ``sidecar.secret`` (mode 0600; its path is printed, never the secret). Then it
serves on ``127.0.0.1:8750`` (``MRTR_KEYS_PORT`` to change) and prints how to plug an MCP server in.
Later runs reuse what is there. A port that is not a port or is in use is one line on stderr, exit 2,
before anything is created or printed. Environment variables: docs/sidecar.md ("Environment").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mrtr_keys.errors import ConfigError, MrtrKeysError

STATE_DIR = Path(".mrtr")
DEMO_CLIENT = "demo"
DEMO_AUDIENCE = "demo"
SECRET_FILE = "sidecar.secret"  # noqa: S105 - a file name


def prepare(state_dir: Path = STATE_DIR) -> tuple[Path, Path, Path]:
    """Create the ring, registry and demo client if missing; returns (ring, registry, secret file) paths."""
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.keystores.file import FileKeystore
    from mrtr_keys.service.clients import add_client, load_registry, registry_path

    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    ring_path = state_dir / "keyring.json"
    store = FileKeystore(ring_path)
    if not store.exists():
        result = create_ring(store)
        print(f"created key ring {ring_path} (primary key {result.ring.primary.kid})")
    registry = registry_path(store.directory, os.environ.get("MRTR_KEYS_CLIENTS"))
    secret_path = state_dir / SECRET_FILE
    if load_registry(registry).get(DEMO_CLIENT) is None or not secret_path.exists():
        if load_registry(registry).get(DEMO_CLIENT) is not None:
            from mrtr_keys.service.clients import remove_client

            remove_client(registry, DEMO_CLIENT)  # its secret file is gone: issue a new one
        _, secret = add_client(registry, DEMO_CLIENT, audiences=[DEMO_AUDIENCE])
        # A new file of mode 0600 renamed over the old one: a secret file left with a wider mode (or a link in
        # its place) is replaced, not written through.
        tmp = secret_path.with_name(f".{SECRET_FILE}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        os.replace(tmp, secret_path)
        print(f"created client {DEMO_CLIENT!r} (audience {DEMO_AUDIENCE!r}); its secret is in {secret_path} (0600)")
    return ring_path, registry, secret_path


ENV_PORT = "MRTR_KEYS_PORT"
DEFAULT_PORT = 8750


def _port(text: str) -> int:
    """`text` as a TCP port. Raises `ConfigError` naming ``MRTR_KEYS_PORT`` otherwise."""

    if text.isascii() and text.isdigit() and 1 <= int(text) <= 65535:
        return int(text)
    raise ConfigError(f"{ENV_PORT} must be an integer from 1 to 65535, not {text!r}")


def main() -> int:
    from mrtr_keys.hardening import harden_process
    from mrtr_keys.service.config import ServiceConfig
    from mrtr_keys.service.server import check_listen_address, serve

    harden_process()  # before the ring and the client secret are made (serve says how it went)
    try:
        port = _port(os.environ.get(ENV_PORT, str(DEFAULT_PORT)))
        check_listen_address("127.0.0.1", port)
        ring_path, registry, secret_path = prepare()
        config = ServiceConfig(keystore=str(ring_path), clients=str(registry), host="127.0.0.1", port=port)
        url = f"http://127.0.0.1:{port}"
        print(
            f"""
mrtr-keys sealing sidecar on {url} (loopback only); key ring {ring_path}, clients {registry}
Plug an MCP server into it:

    from pathlib import Path
    from mcp.server.mcpserver import MCPServer
    import mrtr_keys

    mcp = MCPServer("{DEMO_AUDIENCE}", request_state_security=mrtr_keys.request_state_security(
        sidecar="{url}", secret=Path("{secret_path}").read_text().strip(), audience="{DEMO_AUDIENCE}"))

Another server: mrtr-keys clients add NAME --audience NAME   (prints its secret once)
API and deployment: docs/sidecar.md. Stop with Ctrl+C.
""",
            flush=True,
        )
        serve(config)
    except MrtrKeysError as exc:
        print(f"mrtr-keys: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
