"""The sealing sidecar's app: wiring of the request core, the FastAPI routes and the lifespan.

Routes (see docs/sidecar.md; bytes are unpadded base64url, RFC 4648 section 5):

* ``POST /v1/seal`` ``{audience, payload}`` -> ``{token, kid}``
* ``POST /v1/unseal`` ``{audience, token}`` -> ``{payload, kid}``
* ``POST /v1/seal/batch`` / ``POST /v1/unseal/batch`` ``{items: [...]}`` -> ``{results: [...]}``
  (same order; a bad item gets ``{error: ...}`` and never fails the others; at most
  ``max_batch_items`` items)
* ``GET /v1/keys``: kids, states, times, generation (never material)
* ``GET /healthz``, ``GET /readyz``, ``GET /metrics``: no client secret needed

Status codes: 401 no or wrong bearer secret; 403 a known client asking for an audience or operation it
was not granted (or an audience outside the ring's scope); 413 a body over ``max_body_bytes`` (refused
from Content-Length, or while streaming, before any parsing); 422 an invalid field, named in ``detail``;
400 ``{"error": "invalid_token"}`` for *every* unseal failure, whatever the reason (the reason goes to the
server log and the audit sink only); 503 when the ring's backend cannot be reached.

Speed: `SidecarApp.__call__` dispatches the four POST routes straight from ASGI, before Starlette's
router and middleware; the FastAPI routes (the OpenAPI document, and what serves them when the app is
mounted under a prefix) call the very same handler through the same `respond`. The request core is
`mrtr_keys.service.handlers`; the app holds no crypto: codecs come from `mrtr_keys.factory.open_codec`,
per audience, rebuilt on each new ring generation (`mrtr_keys.service.reload`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response

from mrtr_keys.audit.capture.service_sink import sidecar_audit
from mrtr_keys.codecs.pin import RingPin
from mrtr_keys.errors import ConfigError
from mrtr_keys.keystores import Keystore, open_keystore
from mrtr_keys.service import schemas
from mrtr_keys.service.auth import ClientAuth
from mrtr_keys.service.clients import registry_path
from mrtr_keys.service.config import ServiceConfig
from mrtr_keys.service.handlers import SidecarCore, respond
from mrtr_keys.service.metrics import CONTENT_TYPE
from mrtr_keys.service.outcomes import AuditSink, Handler, Headers, Receive, Result, Scope, Send
from mrtr_keys.service.protocol import ConnectionLimits
from mrtr_keys.service.readiness import probe_audience
from mrtr_keys.service.reload import Keeper, RingState, keep_current
from mrtr_keys.version import __version__

__all__ = ["AuditSink", "SidecarApp", "SidecarCore", "app_from_env", "create_app", "probe_audience"]

log = logging.getLogger("mrtr_keys.service")


async def _send(send: Send, result: Result) -> None:
    status, body, extra = result
    headers: Headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class SidecarApp(FastAPI):
    """FastAPI, with the four sealing routes dispatched straight from ASGI (no router, no middleware).

    `fast_routes` maps each POST path to its handler; an empty table sends every request through the
    FastAPI routes, which call the same handlers.
    """

    core: SidecarCore
    fast_routes: dict[str, Handler]
    connection_limits: ConnectionLimits
    """Read by the HTTP protocol (`mrtr_keys.service.protocol`) for each connection."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # type: ignore[override]
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.fast_routes.get(scope["path"])
            if handler is not None:
                result = await respond(handler, scope, receive)
                if result is not None:
                    await _send(send, result)
                return
        await super().__call__(scope, receive, send)  # type: ignore[arg-type]


def _response(result: Result) -> Response:
    status, body, extra = result
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in extra or ()}
    return Response(body, status, headers=headers, media_type="application/json")


def create_app(
    config: ServiceConfig | None = None,
    *,
    keystore: Keystore | str | None = None,
    audit: AuditSink | None = None,
    backend_options: dict[str, Any] | None = None,
) -> SidecarApp:
    """Build the sidecar app for the ring at `keystore` (else `config.keystore`, env, default).

    Args:
        config: settings (defaults: `ServiceConfig()`).
        keystore: overrides `config.keystore`.
        audit: optional `AuditSink` called once per operation (the audit log's seam); if None and
            `config.audit_factory` names ``module:callable``, that is called with the config.
        backend_options: passed to `open_codec` (KMS / Vault client settings).

    Raises:
        KeyRingNotFound, KeystoreError, KeyRingError, BackendUnavailable: no usable ring at start.
        ConfigError, KeystoreError: the client registry cannot be read.
    """
    config = config or ServiceConfig()
    core = _core(config, keystore, audit, backend_options)
    app = SidecarApp(
        title="mrtr-keys sealing sidecar",
        version=__version__,
        description="Seals and unseals MCP requestState tokens for many servers. See docs/sidecar.md.",
        lifespan=_lifespan(core, keep_current(core, config)),
    )
    app.core = core
    app.connection_limits = ConnectionLimits.from_config(config)
    app.fast_routes = core.routes()
    _add_sealing_routes(app, core)
    _add_probe_routes(app, core)
    app.openapi = functools.partial(_openapi, app)  # type: ignore[method-assign]
    return app


def _core(
    config: ServiceConfig,
    keystore: Keystore | str | None,
    audit: AuditSink | None,
    backend_options: dict[str, Any] | None,
) -> SidecarCore:
    """The request core: the keystore, the audit sink (given, `config.audit_factory`, or the default log
    beside the ring), the ring state with a codec per audience, and the client registry."""
    if keystore is None or isinstance(keystore, str):
        store = open_keystore(keystore or config.keystore, state_dir=config.state_dir)
    else:
        store = keystore
    pin = RingPin.from_settings(config.expect_codec, (backend_options or {}).get("kms_key_id"))
    options = dict(backend_options or {})
    if config.kek_check_every is not None:
        options.setdefault("kek_check_every", config.kek_check_every)
    ring = RingState(store, backend_options=options, pin=pin)  # a refused ring starts no audit writer
    if audit is None and config.audit_factory:
        audit = _load_audit(config)
    elif audit is None:  # default: MRTR_KEYS_AUDIT, else audit.db beside the ring; "off" disables (docs/audit.md)
        audit = sidecar_audit(store.directory, audit=config.audit, strict=config.strict_audit)
    auth = ClientAuth(registry_path(store.directory, config.clients))
    ring.prepare(auth.registry.audiences())
    return SidecarCore(ring, auth, config, audit=audit)


def _lifespan(core: SidecarCore, keeper: Keeper) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Start: the first heartbeat, then the ring watcher, and SIGHUP as "check the ring now". Stop: the
    keeper, the replay store, a last flush of the audit sink and a last anchor of its heads (uvicorn
    re-raises SIGTERM after shutdown, so there is no atexit to rely on)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await anyio.to_thread.run_sync(keeper.start)
        loop = asyncio.get_running_loop()
        hup = False
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError, AttributeError):
            loop.add_signal_handler(signal.SIGHUP, core.wake)
            hup = True
        try:
            yield
        finally:
            if hup:
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(signal.SIGHUP)
            await anyio.to_thread.run_sync(keeper.stop)
            if core.replay is not None:
                core.replay.close()
            flush = getattr(core.audit, "flush", None)  # optional on a sink from audit_factory
            if flush is not None:
                await anyio.to_thread.run_sync(flush)
            if core.anchor is not None:  # the heads as they are after that flush
                await anyio.to_thread.run_sync(core.anchor.run_once)

    return lifespan


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": schemas.ErrorBody, "description": "No or wrong bearer secret."},
    403: {"model": schemas.ErrorBody, "description": "Audience or operation not granted to this client."},
    413: {"model": schemas.ErrorBody, "description": "Body over max_body_bytes."},
    422: {"model": schemas.ErrorBody, "description": "Invalid field (named in detail)."},
    503: {"model": schemas.ErrorBody, "description": "The ring's backend is unreachable."},
}
"""The error answers every sealing route documents in the OpenAPI document."""


def _add_sealing_routes(app: SidecarApp, core: SidecarCore) -> None:
    """The four POST routes as FastAPI routes (the OpenAPI document; a mount under a prefix), each calling
    the fast path's handler."""
    for path, handler in core.routes().items():
        responses: dict[int | str, dict[str, Any]] = {200: {"model": schemas.RESPONSE_MODELS[path]}, **_ERRORS}
        if path == "/v1/unseal":
            responses[400] = {"model": schemas.ErrorBody, "description": "Every unseal failure, whatever the reason."}
        model = schemas.REQUEST_MODELS[path]
        app.add_api_route(
            path,
            _endpoint(handler),
            methods=["POST"],
            responses=responses,
            response_class=Response,
            openapi_extra={
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
                }
            },
            name=path.strip("/").replace("/", "_"),
        )


def _add_probe_routes(app: SidecarApp, core: SidecarCore) -> None:
    """``GET /v1/keys`` (any client), and ``/healthz``, ``/readyz``, ``/metrics`` (no secret needed)."""

    @app.get("/v1/keys", response_model=schemas.KeysResponse, responses={401: {"model": schemas.ErrorBody}})
    async def keys(request: Request) -> Response:
        """Kids, states and times of the loaded ring, its generation (never material). Any client."""
        return _response(core.keys(request.scope))

    @app.get("/healthz")
    async def healthz() -> Response:
        """Alive (no secret needed)."""
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/readyz", response_model=schemas.ReadyResponse, responses={503: {"model": schemas.ReadyResponse}})
    async def readyz(request: Request, strict: bool = False) -> Response:
        """Ring loaded, a seal/unseal self-test passes, and no store is down (``down`` names those that are).

        ``?strict=true``: also 503 while the stored ring is broken (the last good one serving). A caller
        with a valid client secret also gets each store's error text (``audit``, ``replay``)."""
        return _response(await core.readyz(strict, detail=core.client_of(request.scope) is not None))

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format (no secret needed; counts only)."""
        return Response(core.metrics.render(), media_type=CONTENT_TYPE)


def _openapi(app: SidecarApp) -> dict[str, Any]:
    """FastAPI's document, with the request models under ``components/schemas`` (the fast path reads the
    bodies itself, so FastAPI does not see them as parameters)."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in schemas.REQUEST_MODELS.values():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            comps.setdefault(name, sub)
        comps.setdefault(model.__name__, schema)
    app.openapi_schema = doc
    return doc


def _endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """The FastAPI endpoint of a POST route: the fast path's handler, through the same `respond`."""

    async def endpoint(request: Request) -> Response:
        result = await respond(handler, request.scope, request.receive)
        return _response(result if result is not None else (499, b"", None))

    return endpoint


def _load_audit(config: ServiceConfig) -> AuditSink:
    assert config.audit_factory is not None
    module_name, _, attr = config.audit_factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"audit_factory {config.audit_factory!r} cannot be imported: {exc}") from None
    sink: AuditSink = factory(config)
    return sink


ENV_CONFIG = "MRTR_KEYS_SIDECAR_CONFIG"


def app_from_env() -> SidecarApp:
    """Factory for ``uvicorn --factory`` and multi-worker runs: settings from ``MRTR_KEYS_SIDECAR_CONFIG`` (JSON)."""
    import json
    import os

    from mrtr_keys.logs import configure_logging

    configure_logging(level=logging.INFO)  # the format the parent chose (MRTR_KEYS_LOG_FORMAT)
    raw = os.environ.get(ENV_CONFIG)
    config = ServiceConfig.from_json(json.loads(raw)) if raw else ServiceConfig()
    from mrtr_keys.hardening import harden_process

    harden_process(allow_core_dumps=config.allow_core_dumps or None)  # this process will hold the ring's keys
    app = create_app(config)
    tune_gc()
    return app


GC_THRESHOLD = (20_000, 50, 100)
"""gc thresholds (gen0 allocations, gen1, gen2 collections) once serving; defaults are (700, 10, 10)."""


def tune_gc() -> None:
    """Cut collector pauses on the serving path: move everything alive after start-up (imports, the
    app, FastAPI/pydantic schemas) to the permanent generation, so full collections only scan what
    requests create, and collect gen0 less often. A request's objects are freed by reference
    counting; the collector only has the rare cycle (an exception's traceback) to find, which
    a gen0 pass every 20,000 net allocations still does.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
