"""One library MCP server of the chaos fleet: ``python -m bench.chaos.mcp_server --keystore URL --port N ...``.

The example server's ``provision`` tool (`mrtr_keys.example.app.build_server`) with
``mrtr_keys.request_state_security(keystore, audience=..., ttl=..., single_use=URL, on_store_error="deny",
reload_every=..., heartbeat_every=..., instance=..., audit_anchor=DEST, audit_anchor_every=...)``: the library
codec the ring records, its watcher, fence and presence, its audit log (``MRTR_KEYS_AUDIT``) anchored to DEST,
every round single-use in the replay store.

Beside ``/mcp`` it answers ``GET /chaos/status`` with what the product's own objects say about this
process, for the checker (the library has no /readyz or /metrics of its own): the generation and primary
kid loaded, the audit sink's `status()` plus ``written``, the fence (``error``, ``fenced_out``) and the
watcher (``last_check``, ``stuck_since``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from mrtr_keys.errors import MrtrKeysError
from mrtr_keys.example.app import build_server
from mrtr_keys.factory import request_state_security


def _inner(codec: Any) -> Any:
    """The key-ring codec under the single-use wrapper."""
    return getattr(codec, "inner", codec)


def _sink(codec: Any) -> Any:
    observer = getattr(_inner(codec), "_observer", None)
    observer = getattr(observer, "observer", observer)  # the single-use DeferredObserver holds the audit one
    return getattr(observer, "sink", None)


def status(codec: Any) -> dict[str, Any]:
    """What the product's objects of this process say now (see the module docstring)."""
    inner = _inner(codec)
    ring = inner.ring
    doc: dict[str, Any] = {"generation": ring.generation, "primary": ring.primary.kid}
    sink = _sink(codec)
    if sink is not None:
        doc["audit"] = {**sink.status(), "written": sink.written}
    fence = getattr(inner, "fence", None)
    if fence is not None:
        doc["fence"] = {"error": fence.error, "fenced_out": fence.fenced_out, "note": fence.note()}
    watcher = getattr(inner, "watcher", None)
    if watcher is not None:
        since = watcher.stuck_since()
        doc["watcher"] = {"last_check": watcher.last_check, "stuck_since": since, "error": watcher.error}
    presence = getattr(inner, "presence", None)
    if presence is not None:
        doc["presence_note"] = getattr(presence, "last_note", None)
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos.mcp_server")
    parser.add_argument("--keystore", required=True)
    parser.add_argument("--audience", default="provisioner")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--instance", required=True)
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--reload-every", type=float, default=1.0)
    parser.add_argument("--heartbeat-every", type=float, default=2.0)
    parser.add_argument("--single-use", required=True)
    parser.add_argument("--audit-anchor", default=None)
    parser.add_argument("--audit-anchor-every", type=float, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)-8s %(name)s: %(message)s")
    try:
        security = request_state_security(
            args.keystore,
            audience=args.audience,
            ttl=args.ttl,
            single_use=args.single_use,
            on_store_error="deny",
            reload_every=args.reload_every,
            heartbeat_every=args.heartbeat_every,
            instance=args.instance,
            audit_anchor=args.audit_anchor,
            audit_anchor_every=args.audit_anchor_every,
        )
    except MrtrKeysError as exc:  # as the example server does: one line and its exit code
        print(f"python -m bench.chaos.mcp_server: error: {exc}", file=sys.stderr)
        return exc.exit_code
    codec = security.codec
    mcp = build_server(security, name=args.audience, instance=args.instance)
    app = mcp.streamable_http_app(streamable_http_path="/mcp", json_response=True, host="127.0.0.1")

    async def chaos_status(request: Request) -> JSONResponse:
        return JSONResponse(status(codec))

    app.router.routes.append(Route("/chaos/status", chaos_status))
    print(f"chaos MCP server {args.instance} on 127.0.0.1:{args.port}", flush=True)
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning")).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
