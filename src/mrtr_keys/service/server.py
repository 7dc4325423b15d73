"""Running the sidecar under uvicorn (httptools + uvloop), on TCP or on a Unix socket created 0600.

uvicorn's own ``--uds`` makes the socket mode 0666; we bind it ourselves under
a 0177 umask, chmod it 0600 and hand uvicorn the descriptor, so only the
sidecar's user (and root) can connect: the file mode is the access control.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any

from mrtr_keys.errors import ConfigError
from mrtr_keys.hardening import harden_process
from mrtr_keys.service.config import ServiceConfig

log = logging.getLogger("mrtr_keys.service")


def bind_unix_socket(path: str | os.PathLike[str]) -> socket.socket:
    """A listening-ready AF_UNIX socket at `path`, mode 0600; a stale socket file there is replaced.

    Raises:
        ConfigError: `path` exists and is not a socket, or another process is listening on it.
    """
    p = Path(path)
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(p)
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"{p} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if probe.connect_ex(str(p)) == 0:
                raise ConfigError(f"another process is listening on {p}")
        finally:
            probe.close()
        p.unlink()
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(p))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {p}: {exc.strerror}") from None
    finally:
        os.umask(old)
    os.chmod(p, 0o600)
    sock.set_inheritable(True)
    return sock


def check_listen_address(host: str, port: int) -> None:
    """Bind `host`:`port` once, as uvicorn will (SO_REUSEADDR), and let go: fail before printing anything.

    Raises:
        ConfigError: the port is in use or the address is not this host's (one line, exit 2).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


HTTP_PROTOCOLS = {
    "corked": "mrtr_keys.service.corked:CorkedHttpToolsProtocol",
    "httptools": "mrtr_keys.service.protocol:LimitedHttpToolsProtocol",
}
"""``http`` setting -> uvicorn protocol class: httptools with the connection limits, writing each response
in one ``writev`` (``corked``, `mrtr_keys.service.corked`) or with uvicorn's own writes (``httptools``); see
`mrtr_keys.service.protocol`."""


def _uvicorn_options(config: ServiceConfig) -> dict[str, Any]:
    return {
        "loop": "uvloop",
        "http": HTTP_PROTOCOLS[config.http],
        "lifespan": "on",
        "access_log": False,
        "server_header": False,
        "proxy_headers": False,  # no X-Forwarded-For rewriting: one less ASGI layer per request
        "log_level": "warning",
        "timeout_keep_alive": config.keep_alive_timeout,
        "backlog": 2048,
    }


FD_RESERVE = 256
"""File descriptors kept for everything but client connections (ring files, audit store, logs, workers)."""


def raise_fd_limit(max_connections: int) -> int:
    """Raise this process's soft open-file limit toward its hard limit to fit `max_connections`.

    Returns the connection cap that fits (`max_connections`, or fewer when the hard limit is lower, with a
    warning), so a flood is refused with 503 instead of failing ``accept`` with EMFILE.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
    if soft != resource.RLIM_INFINITY and soft < want:
        fits = max(1, soft - FD_RESERVE)
        log.warning("open-file limit %d fits %d connections, not max_connections=%d", soft, fits, max_connections)
        return fits
    return max_connections


def _server_class() -> type[Any]:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, removing our Unix socket file on shutdown (uvicorn re-raises the signal after)."""

        def __init__(self, config: uvicorn.Config, *, unlink: str | None) -> None:
            super().__init__(config)
            self._unlink = unlink

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)
            if self._unlink:
                with contextlib.suppress(OSError):
                    os.unlink(self._unlink)

    return Server


def warn_if_no_clients(registry: Any, path: Path, config: ServiceConfig) -> None:
    """Log a WARNING when the client registry is empty: every call would get 401 until a client is added."""
    if len(registry) == 0:
        where = f" --keystore {config.keystore}" if config.keystore else ""
        log.warning(
            "no sidecar clients in %s: every seal and unseal gets 401 until one is added (picked up without a "
            "restart): mrtr-keys clients add NAME --audience AUDIENCE%s",
            path,
            where,
        )


def serve(config: ServiceConfig) -> None:
    """Run the sidecar until SIGINT/SIGTERM (blocking). One worker runs in this process.

    Raises:
        KeyRingNotFound, KeystoreError, KeyRingError, ConfigError: nothing usable to serve.
    """
    import uvicorn

    from mrtr_keys.service.app import create_app, tune_gc

    _Server = _server_class()

    from mrtr_keys.logs import configure_logging

    hardening = harden_process(allow_core_dumps=config.allow_core_dumps or None)  # before any key is read
    configure_logging(config.log_format, level=logging.INFO)  # else MRTR_KEYS_LOG_FORMAT, else text
    if not hardening.hardened:  # said at once; when hardened, the serving line says so
        log.warning("%s", hardening.note)
    guarded = ", process hardened" if hardening.hardened else ""
    config = config.with_overrides(max_connections=raise_fd_limit(config.max_connections))
    sock = bind_unix_socket(config.uds) if config.uds else None
    where = f"unix:{config.uds}" if config.uds else f"http://{config.host}:{config.port}"
    try:
        if config.workers == 1:
            app = create_app(config)
            warn_if_no_clients(app.core.auth.registry, app.core.auth.path, config)
            log.info(
                "sidecar serving key ring generation %d on %s (reload every %g s, http %s, at most %d connections%s)",
                app.core.ring.ring.generation,
                where,
                config.reload_interval,
                config.http,
                config.max_connections,
                guarded,
            )
            uv = uvicorn.Config(app, host=config.host, port=config.port, **_uvicorn_options(config))
            tune_gc()
            _Server(uv, unlink=config.uds).run(sockets=[sock] if sock else None)
        else:
            first = create_app(config)  # fail fast here, not in N workers
            warn_if_no_clients(first.core.auth.registry, first.core.auth.path, config)
            log.info("sidecar starting %d workers on %s (http %s%s)", config.workers, where, config.http, guarded)
            opts: dict[str, Any] = {"fd": sock.fileno()} if sock else {"host": config.host, "port": config.port}
            uvicorn.run(
                worker_import_string(config),
                factory=True,
                workers=config.workers,
                **opts,
                **_uvicorn_options(config),
            )
    finally:
        if sock is not None:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(str(config.uds))


_WORKER_APP = "worker_app_"


def worker_import_string(config: ServiceConfig) -> str:
    """The ``module:attribute`` uvicorn imports in each worker process: a factory of the app for `config`.

    uvicorn hands spawned workers nothing but an import string, so the settings travel inside it (the
    hex of their JSON; paths, numbers and URLs, no secret), not through this process's environment.
    """
    doc = json.dumps(config.to_json(), sort_keys=True, separators=(",", ":"))
    return f"{__name__}:{_WORKER_APP}{doc.encode().hex()}"


def __getattr__(name: str) -> Any:
    """Resolve `worker_import_string`'s attribute to an app factory over the settings it carries."""
    if not name.startswith(_WORKER_APP):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        config = ServiceConfig.from_json(json.loads(bytes.fromhex(name.removeprefix(_WORKER_APP))))
    except ValueError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    return functools.partial(_worker_app, config)


def _worker_app(config: ServiceConfig) -> Any:
    from mrtr_keys.logs import configure_logging
    from mrtr_keys.service.app import create_app, tune_gc

    harden_process(allow_core_dumps=config.allow_core_dumps or None)  # a spawned worker is dumpable again (execve)
    configure_logging(config.log_format, level=logging.INFO)
    app = create_app(config)
    tune_gc()
    return app
