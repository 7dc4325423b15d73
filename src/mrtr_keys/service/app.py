"""The sealing sidecar: a FastAPI app that seals and unseals request-state tokens for many MCP servers.

Routes (see docs/sidecar.md; bytes are unpadded base64url, RFC 4648 section 5):

* ``POST /v1/seal`` ``{audience, payload}`` -> ``{token, kid}``
* ``POST /v1/unseal`` ``{audience, token}`` -> ``{payload, kid}``
* ``POST /v1/seal/batch`` / ``POST /v1/unseal/batch`` ``{items: [...]}`` -> ``{results: [...]}``
  (same order; a bad item gets ``{error: ...}`` and never fails the others; at most
  ``max_batch_items`` items)
* ``GET /v1/keys``: kids, states, times, generation (never material)
* ``GET /healthz``, ``GET /readyz``, ``GET /metrics``: no client secret needed

Status codes: 401 no or wrong bearer secret; 403 a known client asking for an
audience or operation it was not granted (or an audience outside the ring's
scope); 413 a body over ``max_body_bytes`` (refused from Content-Length, or
while streaming, before any parsing); 422 an invalid field, named in
``detail``; 400 ``{"error": "invalid_token"}`` for *every* unseal failure,
whatever the reason (the reason goes to the server log and the audit sink
only); 503 when the ring's backend cannot be reached.

Speed: the four POST routes are plain ``async`` handlers over raw ASGI
(`SidecarApp.__call__` dispatches them before Starlette routing; the FastAPI
routes call the very same handlers and exist for the OpenAPI document and for
mounting). The local, KMS-envelope and Vault data-key codecs keep their keys in
memory, so they run on the event loop (microseconds, no thread hop); a codec
that may call out per token runs in a worker thread. Bodies are parsed with
orjson and fields checked by hand against the models in `schemas`.

The app holds no crypto: codecs come from `mrtr_keys.factory.open_codec`, per
audience, rebuilt on each new ring generation (`mrtr_keys.service.reload`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio.to_thread
import orjson
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.backends import Codec
from mrtr_keys.errors import AudienceError, MrtrKeysError
from mrtr_keys.keystores import Keystore, open_keystore
from mrtr_keys.ring.model import KeyRing
from mrtr_keys.ring.scope import MAX_AUDIENCE_CHARS
from mrtr_keys.service import schemas
from mrtr_keys.service.auth import ClientAuth, bearer_secret
from mrtr_keys.service.clients import Client, registry_path
from mrtr_keys.service.config import ServiceConfig
from mrtr_keys.service.metrics import CONTENT_TYPE, SidecarMetrics
from mrtr_keys.service.reload import PROBE_AUDIENCE, RingState
from mrtr_keys.token import MalformedToken, b64u_decode, b64u_encode

log = logging.getLogger("mrtr_keys.service")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
Result = tuple[int, bytes, Headers | None]
Handler = Callable[[Scope, Receive], Awaitable[Result]]

MAX_PAYLOAD_B64_CHARS = (schemas.MAX_PAYLOAD_BYTES * 4 + 2) // 3
_STALE_NOTE = "the stored key ring cannot be loaded; serving the last good generation (see the server log)"


class AuditSink(Protocol):
    """Receives one call per seal/unseal operation (each batch item) and per refused request.

    Never receives a payload. `token` is the sealed or presented token (to fingerprint, never to
    store); `outcome` is one of ``ok``, ``rejected``, ``unauthorized``, ``forbidden``, ``invalid``,
    ``too_large``, ``unavailable``, ``error``; `reason` is the log-only reason code. Must return
    quickly; with ``strict_audit`` an exception fails the request with 503.
    """

    def __call__(
        self,
        *,
        op: str,
        audience: str | None,
        client: str | None,
        kid: str | None,
        outcome: str,
        reason: str | None,
        token: str | None,
        duration_ms: float,
    ) -> None: ...


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class _AuditFailed(Exception):
    pass


@dataclass(slots=True)
class _Outcome:
    outcome: str
    status: int
    body: dict[str, Any]
    audience: str | None = None
    kid: str | None = None
    reason: str | None = None
    token: str | None = None
    detail: list[dict[str, Any]] | None = field(default=None)


def _dump(obj: Any) -> bytes:
    return orjson.dumps(obj)


_UNAUTHORIZED: Result = (401, _dump({"error": "unauthorized"}), [(b"www-authenticate", b'Bearer realm="mrtr-keys"')])
_FORBIDDEN_BODY = {"error": "forbidden"}
_INVALID_TOKEN_BODY = {"error": "invalid_token"}
_UNAVAILABLE_BODY = {"error": "backend_unavailable"}
_INTERNAL_BODY = {"error": "internal"}
_AUDIT_FAILED: Result = (503, _dump({"error": "audit_unavailable"}), None)


def _invalid(loc: tuple[str | int, ...], msg: str) -> _Outcome:
    return _Outcome("invalid", 422, {"error": "invalid_request"}, detail=[{"loc": list(loc), "msg": msg}])


def _loc_text(loc: list[Any]) -> str:
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def probe_audience(ring: KeyRing) -> str:
    """The audience the readiness self-test seals for: the first in scope, else `PROBE_AUDIENCE`."""
    return ring.audiences[0] if ring.audiences else PROBE_AUDIENCE


class SidecarCore:
    """Request handling shared by the fast ASGI path and the FastAPI routes.

    Args:
        ring: the live key ring (`RingState`).
        auth: the live client registry (`ClientAuth`).
        config: limits and the reload interval.
        audit: optional `AuditSink`.
    """

    def __init__(
        self, ring: RingState, auth: ClientAuth, config: ServiceConfig, *, audit: AuditSink | None = None
    ) -> None:
        self.ring = ring
        self.auth = auth
        self.config = config
        self.audit = audit
        self.strict_audit = config.strict_audit
        self._ring_loaded()
        self.metrics = SidecarMetrics()
        self.metrics.generation.set(ring.ring.generation)
        if audit is not None:
            self.metrics.watch_audit(getattr(audit, "sink", audit))
        self._max_body = config.max_body_bytes
        self._wake: asyncio.Event | None = None

    # ---------------------------------------------------------------- plumbing

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The request body, refused (`_TooLarge`) as soon as it exceeds the limit."""
        limit = self._max_body
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _Disconnected
            chunk: bytes = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _declared_too_large(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    return int(value) > self._max_body
                except ValueError:
                    return True
        return False

    def _client(self, scope: Scope) -> Client | None:
        secret = bearer_secret(scope["headers"])
        return None if secret is None else self.auth.authenticate(secret)

    def _record(self, op: str, client: Client | None, out: _Outcome, t0: float, *, granted: bool, n: int = 1) -> None:
        audience = out.audience if granted and out.audience is not None else "-"
        self.metrics.count(op, audience, out.outcome, n)
        sink = self.audit
        if sink is not None:
            self._audit(sink, op, client.name if client is not None else None, out, t0)

    def _audit(self, sink: AuditSink, op: str, client: str | None, out: _Outcome, t0: float) -> None:
        """One audit event; `_AuditFailed` if the sink fails and audit is strict."""
        try:
            sink(
                op=op,
                audience=out.audience,
                client=client,
                kid=out.kid,
                outcome=out.outcome,
                reason=out.reason,
                token=out.token,
                duration_ms=(time.perf_counter() - t0) * 1000.0,
            )
        except Exception:
            log.exception("audit sink failed")
            if self.strict_audit:
                raise _AuditFailed from None

    async def _codec(self, audience: str) -> Codec:
        codec = self.ring.snapshot.codecs.get(audience)
        if codec is None:
            codec = await anyio.to_thread.run_sync(self.ring.open, audience)
        return codec

    async def _run(self, fn: Callable[[Any], Any], arg: Any) -> tuple[Any, str | None]:
        """Call a codec method: on the event loop for in-memory codecs, else in a worker thread."""
        if self.ring.inline:
            return self._call(fn, arg)
        return await anyio.to_thread.run_sync(self._call, fn, arg)

    def _call(self, fn: Callable[[Any], Any], arg: Any) -> tuple[Any, str | None]:
        tap = self.ring.tap
        tap.clear()
        try:
            value = fn(arg)
        except InvalidRequestState as exc:
            raise _Rejected(str(exc), tap.take()) from None
        return value, tap.take()

    async def _pre(
        self, op: str, route: str, scope: Scope, receive: Receive, t0: float
    ) -> tuple[Client, dict[str, Any]] | Result:
        """413 / 401 / 403 (operation) / 422 (not a JSON object) checks shared by every POST route."""
        if self._declared_too_large(scope):
            return self._refuse(op, route, None, _Outcome("too_large", 413, self._too_large_body()), t0)
        client = self._client(scope)
        if client is None:
            self._refuse(op, route, None, _Outcome("unauthorized", 401, {}), t0)
            return _UNAUTHORIZED
        if op not in client.ops:
            return self._refuse(op, route, client, _Outcome("forbidden", 403, _FORBIDDEN_BODY, reason="operation"), t0)
        try:
            body = await self._read_body(scope, receive)
        except _TooLarge:
            return self._refuse(op, route, client, _Outcome("too_large", 413, self._too_large_body()), t0)
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return self._refuse(op, route, client, _invalid(("body",), "not a JSON document"), t0)
        if not isinstance(doc, dict):
            return self._refuse(op, route, client, _invalid(("body",), "must be a JSON object"), t0)
        return client, doc

    def _too_large_body(self) -> dict[str, Any]:
        return {"error": "body_too_large", "max_bytes": self._max_body}

    def _refuse(self, op: str, route: str, client: Client | None, out: _Outcome, t0: float) -> Result:
        try:
            self._record(op, client, out, t0, granted=False)
        except _AuditFailed:
            return _AUDIT_FAILED
        self.metrics.observe(route, time.perf_counter() - t0)
        return self._single(out)

    @staticmethod
    def _single(out: _Outcome) -> Result:
        if out.detail is not None:
            return out.status, _dump({"error": "invalid_request", "detail": out.detail}), None
        return out.status, _dump(out.body), None

    @staticmethod
    def _result_item(out: _Outcome) -> dict[str, Any]:
        if out.detail is not None:
            d = out.detail[0]
            return {"error": "invalid_request", "detail": f"{_loc_text(d['loc'])}: {d['msg']}"}
        return out.body

    # ---------------------------------------------------------------- items

    def _fields(self, item: object, loc: tuple[str | int, ...], second: str) -> tuple[str, str] | _Outcome:
        if not isinstance(item, dict):
            return _invalid(loc, "must be a JSON object")
        if len(item) != 2 or "audience" not in item or second not in item:
            for name in sorted(item):
                if name not in ("audience", second):
                    return _invalid((*loc, name), "extra field not permitted")
        audience = item.get("audience")
        if not isinstance(audience, str) or not 1 <= len(audience) <= MAX_AUDIENCE_CHARS:
            return _invalid((*loc, "audience"), f"required: a string of 1-{MAX_AUDIENCE_CHARS} characters")
        value = item.get(second)
        if not isinstance(value, str):
            what = "unpadded base64url text" if second == "payload" else "a token string"
            return _invalid((*loc, second), f"required: {what}")
        return audience, value

    def _seal_check(self, client: Client, item: object, loc: tuple[str | int, ...]) -> tuple[str, bytes] | _Outcome:
        """Validate one seal item: (audience, payload bytes), or the refusal."""
        fields = self._fields(item, loc, "payload")
        if isinstance(fields, _Outcome):
            return fields
        audience, text = fields
        if len(text) > MAX_PAYLOAD_B64_CHARS:
            return _invalid((*loc, "payload"), f"longer than {schemas.MAX_PAYLOAD_BYTES} bytes")
        try:
            payload = b64u_decode(text)
        except MalformedToken:
            return _invalid((*loc, "payload"), "not unpadded base64url (RFC 4648 section 5)")
        if not client.allows("seal", audience):
            return _Outcome("forbidden", 403, _FORBIDDEN_BODY, audience, reason="audience")
        return audience, payload

    def _unseal_check(self, client: Client, item: object, loc: tuple[str | int, ...]) -> tuple[str, str] | _Outcome:
        """Validate one unseal item: (audience, token), or the refusal."""
        fields = self._fields(item, loc, "token")
        if isinstance(fields, _Outcome):
            return fields
        if not client.allows("unseal", fields[0]):
            return _Outcome("forbidden", 403, _FORBIDDEN_BODY, fields[0], reason="audience")
        return fields

    def _seal_with(self, codec: Codec, audience: str, payload: bytes, client: Client) -> _Outcome:
        """Seal with `codec` (on the loop or in a worker thread), mapping every failure to an outcome."""
        try:
            token, kid = self._call(codec.seal, payload)
        except AudienceError:
            return _Outcome("forbidden", 403, _FORBIDDEN_BODY, audience, reason="audience outside the key ring")
        except MrtrKeysError as exc:
            log.warning("seal failed (audience=%r): %s", audience, exc)
            return _Outcome("unavailable", 503, _UNAVAILABLE_BODY, audience, reason=type(exc).__name__)
        except _Rejected as exc:  # a codec refusing to seal: treat as a server fault
            log.error("seal refused by the codec (audience=%r): %s", audience, exc.reason)
            return _Outcome("error", 500, _INTERNAL_BODY, audience, reason=exc.reason)
        except Exception:
            log.exception("seal failed (audience=%r)", audience)
            return _Outcome("error", 500, _INTERNAL_BODY, audience, reason="internal")
        return _Outcome("ok", 200, {"token": token, "kid": kid}, audience, kid, None, token)

    def _unseal_with(self, codec: Codec, audience: str, token: str, client: Client) -> _Outcome:
        """Unseal with `codec` (on the loop or in a worker thread), mapping every failure to an outcome."""
        try:
            payload, kid = self._call(codec.unseal, token)
        except _Rejected as exc:
            log.info("unseal rejected (audience=%r client=%s kid=%s): %s", audience, client.name, exc.kid, exc.reason)
            return _Outcome("rejected", 400, _INVALID_TOKEN_BODY, audience, exc.kid, exc.reason, token)
        except AudienceError:
            return _Outcome("forbidden", 403, _FORBIDDEN_BODY, audience, reason="audience outside the key ring")
        except MrtrKeysError as exc:
            log.warning("unseal failed (audience=%r): %s", audience, exc)
            return _Outcome("unavailable", 503, _UNAVAILABLE_BODY, audience, reason=type(exc).__name__, token=token)
        except Exception:
            log.exception("unseal failed (audience=%r)", audience)
            return _Outcome("error", 500, _INTERNAL_BODY, audience, reason="internal", token=token)
        return _Outcome("ok", 200, {"payload": b64u_encode(payload), "kid": kid}, audience, kid, None, token)

    async def _open_codec(self, op: str, audience: str, token: str | None) -> Codec | _Outcome:
        """The codec for `audience` when it is not built yet (opening may do I/O: worker thread)."""
        try:
            return await self._codec(audience)
        except AudienceError:
            return _Outcome("forbidden", 403, _FORBIDDEN_BODY, audience, reason="audience outside the key ring")
        except MrtrKeysError as exc:
            log.warning("%s failed (audience=%r): %s", op, audience, exc)
            return _Outcome("unavailable", 503, _UNAVAILABLE_BODY, audience, reason=type(exc).__name__, token=token)
        except Exception:
            log.exception("%s failed (audience=%r)", op, audience)
            return _Outcome("error", 500, _INTERNAL_BODY, audience, reason="internal", token=token)

    async def _item(self, op: str, client: Client, item: object, loc: tuple[str | int, ...]) -> _Outcome:
        """One seal or unseal item, start to end (awaits only to open a codec or run a remote one)."""
        if op == "seal":
            checked: tuple[str, Any] | _Outcome = self._seal_check(client, item, loc)
            with_codec = self._seal_with
        else:
            checked = self._unseal_check(client, item, loc)
            with_codec = self._unseal_with  # type: ignore[assignment]
        if isinstance(checked, _Outcome):
            return checked
        audience, value = checked
        codec = self.ring.snapshot.codecs.get(audience)
        if codec is None:
            opened = await self._open_codec(op, audience, value if op == "unseal" else None)
            if isinstance(opened, _Outcome):
                return opened
            codec = opened
        if self.ring.inline:
            return with_codec(codec, audience, value, client)
        return await anyio.to_thread.run_sync(with_codec, codec, audience, value, client)

    # ---------------------------------------------------------------- routes

    async def _one(self, op: str, route: str, scope: Scope, receive: Receive) -> Result:
        t0 = time.perf_counter()
        pre = await self._pre(op, route, scope, receive, t0)
        if isinstance(pre[0], int):
            return pre  # type: ignore[return-value]
        client, doc = pre  # type: ignore[misc]
        out = await self._item(op, client, doc, ("body",))
        try:
            self._record(op, client, out, t0, granted=out.outcome not in ("forbidden", "invalid"))
        except _AuditFailed:
            return _AUDIT_FAILED
        self.metrics.observe(route, time.perf_counter() - t0)
        return self._single(out)

    async def _batch(self, op: str, route: str, scope: Scope, receive: Receive) -> Result:
        t0 = time.perf_counter()
        pre = await self._pre(op, route, scope, receive, t0)
        if isinstance(pre[0], int):
            return pre  # type: ignore[return-value]
        client, doc = pre  # type: ignore[misc]
        for name in doc:
            if name != "items":
                return self._refuse(op, route, client, _invalid(("body", name), "extra field not permitted"), t0)
        items = doc.get("items")
        limit = self.config.max_batch_items
        if not isinstance(items, list) or not 1 <= len(items) <= limit:
            return self._refuse(
                op, route, client, _invalid(("body", "items"), f"required: a list of 1 to {limit} items"), t0
            )
        try:
            if self.ring.inline:
                results = await self._batch_inline(op, client, items, t0)
            else:
                results = []
                for i, item in enumerate(items):
                    out = await self._item(op, client, item, ("items", i))
                    self._record(op, client, out, t0, granted=out.outcome not in ("forbidden", "invalid"))
                    results.append(self._result_item(out))
        except _AuditFailed:
            return _AUDIT_FAILED
        self.metrics.observe(route, time.perf_counter() - t0)
        return 200, _dump({"results": results}), None

    async def _batch_inline(self, op: str, client: Client, items: list[Any], t0: float) -> list[dict[str, Any]]:
        """The batch loop for in-memory codecs: no coroutine, thread hop or metrics lookup per item.

        Same results, audit events and counts as running `_item` per item: each item is checked,
        sealed or unsealed on the loop, audited, and counted (counters added once per batch).
        """
        seal = op == "seal"
        check = self._seal_check if seal else self._unseal_check
        with_codec = self._seal_with if seal else self._unseal_with
        codecs = self.ring.snapshot.codecs
        sink = self.audit
        name = client.name
        tally: dict[tuple[str, str], int] = {}
        results: list[dict[str, Any]] = []
        append = results.append
        try:
            for i, item in enumerate(items):
                checked = check(client, item, ("items", i))
                if isinstance(checked, _Outcome):
                    out = checked
                else:
                    audience, value = checked
                    codec = codecs.get(audience)
                    if codec is None:
                        out = await self._item(op, client, item, ("items", i))
                    else:
                        out = with_codec(codec, audience, value, client)  # type: ignore[arg-type]
                outcome = out.outcome
                key = (
                    out.audience if outcome not in ("forbidden", "invalid") and out.audience is not None else "-",
                    outcome,
                )
                tally[key] = tally.get(key, 0) + 1
                if sink is not None:
                    self._audit(sink, op, name, out, t0)
                append(out.body if out.detail is None else self._result_item(out))
        finally:
            count = self.metrics.count
            for (audience, outcome), n in tally.items():
                count(op, audience, outcome, n)
        return results

    async def seal(self, scope: Scope, receive: Receive) -> Result:
        return await self._one("seal", "/v1/seal", scope, receive)

    async def unseal(self, scope: Scope, receive: Receive) -> Result:
        return await self._one("unseal", "/v1/unseal", scope, receive)

    async def seal_batch(self, scope: Scope, receive: Receive) -> Result:
        return await self._batch("seal", "/v1/seal/batch", scope, receive)

    async def unseal_batch(self, scope: Scope, receive: Receive) -> Result:
        return await self._batch("unseal", "/v1/unseal/batch", scope, receive)

    def keys(self, scope: Scope) -> Result:
        if self._client(scope) is None:
            return _UNAUTHORIZED
        doc = self.ring.ring.describe()
        doc["reload_error"] = _STALE_NOTE if self.ring.error else None
        return 200, _dump(doc), None

    async def readyz(self, strict: bool = False) -> Result:
        """200 when the ring is loaded and a seal/unseal self-test passes (backend reachable), else 503.

        With `strict`, a stored ring that cannot be loaded (last good one serving) also gives 503.
        """
        ring = self.ring.ring
        stale = _STALE_NOTE if self.ring.error else None
        try:
            codec = await self._codec(probe_audience(ring))
            token, _ = await self._run(codec.seal, b"readyz")
            payload, _ = await self._run(codec.unseal, token)
            ok = payload == b"readyz"
        except Exception as exc:
            log.warning("readiness self-test failed: %s", getattr(exc, "reason", None) or type(exc).__name__)
            ok = False
        doc: dict[str, Any] = {"ready": ok, "generation": ring.generation, "reload_error": stale}
        if not ok:
            doc["reason"] = "the key ring's codec failed a seal/unseal self-test (backend unreachable?)"
        audit_ready = getattr(self.audit, "ready", None)
        if ok and audit_ready is not None and not audit_ready():
            ok = False
            doc["reason"] = "the audit store cannot be written (see the server log)"
        ready = ok and not (strict and stale)
        doc["ready"] = ready
        return (200 if ready else 503), _dump(doc), None

    # ---------------------------------------------------------------- reload

    def reload_now(self) -> bool:
        """Poll the client registry and the keystore once (blocking I/O: call off the event loop)."""
        registry_changed = self.auth.refresh()
        audiences = self.auth.registry.audiences()
        if registry_changed:
            self.ring.prepare(audiences)
        had_error = self.ring.error
        switched = self.ring.reload(audiences)
        if switched:
            self._ring_loaded()
            self.metrics.reloads.labels("switched").inc()
            self.metrics.generation.set(self.ring.ring.generation)
        elif self.ring.error and self.ring.error != had_error:
            self.metrics.reloads.labels("failed").inc()
        self.metrics.stale.set(1 if self.ring.error else 0)
        return switched

    def _ring_loaded(self) -> None:
        """Record ``ring-loaded`` in the audit log (synchronously) if the sink supports it (docs/audit.md)."""
        hook = getattr(self.audit, "ring_loaded", None)
        if hook is not None:
            hook(self.ring.ring.generation, self.ring.ring.primary.kid)

    def wake(self) -> None:
        """Ask the reload loop to poll now (SIGHUP)."""
        if self._wake is not None:
            self._wake.set()

    async def reload_loop(self) -> None:
        self._wake = wake = asyncio.Event()
        interval = self.config.reload_interval
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), interval)
            wake.clear()
            try:
                await anyio.to_thread.run_sync(self.reload_now)
            except Exception:
                log.exception("reload failed")


class _Rejected(Exception):
    def __init__(self, reason: str, kid: str | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kid = kid


async def _send(send: Send, result: Result) -> None:
    status, body, extra = result
    headers: Headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if extra:
        headers.extend(extra)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class SidecarApp(FastAPI):
    """FastAPI, with the four sealing routes dispatched straight from ASGI (no router, no middleware)."""

    core: SidecarCore
    fast_routes: dict[str, Handler]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:  # type: ignore[override]
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.fast_routes.get(scope["path"])
            if handler is not None:
                try:
                    result = await handler(scope, receive)
                except _Disconnected:
                    return
                except Exception:
                    log.exception("request failed")
                    result = (500, _dump(_INTERNAL_BODY), None)
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
    if keystore is None or isinstance(keystore, str):
        store = open_keystore(keystore or config.keystore)
    else:
        store = keystore
    if audit is None and config.audit_factory:
        audit = _load_audit(config)
    elif audit is None:  # default: MRTR_KEYS_AUDIT, else audit.db beside the ring; "off" disables (docs/audit.md)
        from mrtr_keys.audit.sidecar import sidecar_audit

        audit = sidecar_audit(store.directory, strict=config.strict_audit)
    ring = RingState(store, backend_options=backend_options)
    auth = ClientAuth(registry_path(store.directory, config.clients))
    ring.prepare(auth.registry.audiences())
    core = SidecarCore(ring, auth, config, audit=audit)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(core.reload_loop())
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
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            flush = getattr(audit, "flush", None)  # uvicorn re-raises SIGTERM after shutdown: no atexit
            if flush is not None:
                await anyio.to_thread.run_sync(flush)

    app = SidecarApp(
        title="mrtr-keys sealing sidecar",
        version=_version(),
        description="Seals and unseals MCP requestState tokens for many servers. See docs/sidecar.md.",
        lifespan=lifespan,
    )
    app.core = core
    app.fast_routes = {
        "/v1/seal": core.seal,
        "/v1/unseal": core.unseal,
        "/v1/seal/batch": core.seal_batch,
        "/v1/unseal/batch": core.unseal_batch,
    }
    errors: dict[int | str, dict[str, Any]] = {
        401: {"model": schemas.ErrorBody, "description": "No or wrong bearer secret."},
        403: {"model": schemas.ErrorBody, "description": "Audience or operation not granted to this client."},
        413: {"model": schemas.ErrorBody, "description": "Body over max_body_bytes."},
        422: {"model": schemas.ErrorBody, "description": "Invalid field (named in detail)."},
        503: {"model": schemas.ErrorBody, "description": "The ring's backend is unreachable."},
    }
    for path, handler in app.fast_routes.items():
        responses: dict[int | str, dict[str, Any]] = {200: {"model": schemas.RESPONSE_MODELS[path]}, **errors}
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

    @app.get("/v1/keys", response_model=schemas.KeysResponse, responses={401: {"model": schemas.ErrorBody}})
    async def keys(request: Request) -> Response:
        """Kids, states and times of the loaded ring, its generation (never material). Any client."""
        return _response(core.keys(request.scope))

    @app.get("/healthz")
    async def healthz() -> Response:
        """Alive (no secret needed)."""
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/readyz", response_model=schemas.ReadyResponse, responses={503: {"model": schemas.ReadyResponse}})
    async def readyz(strict: bool = False) -> Response:
        """Ring loaded and a seal/unseal self-test passes.

        ``?strict=true``: also 503 while the stored ring is broken (the last good one serving)."""
        return _response(await core.readyz(strict))

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format (no secret needed; counts only)."""
        return Response(core.metrics.render(), media_type=CONTENT_TYPE)

    def openapi() -> dict[str, Any]:
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

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return _response(await handler(request.scope, request.receive))

    return endpoint


def _load_audit(config: ServiceConfig) -> AuditSink:
    assert config.audit_factory is not None
    module_name, _, attr = config.audit_factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise MrtrKeysError(f"audit_factory {config.audit_factory!r} cannot be imported: {exc}") from None
    sink: AuditSink = factory(config)
    return sink


def _version() -> str:
    from mrtr_keys import __version__

    return __version__


ENV_CONFIG = "MRTR_KEYS_SIDECAR_CONFIG"


def app_from_env() -> SidecarApp:
    """Factory for ``uvicorn --factory`` and multi-worker runs: settings from ``MRTR_KEYS_SIDECAR_CONFIG`` (JSON)."""
    import json
    import os

    raw = os.environ.get(ENV_CONFIG)
    config = ServiceConfig.from_json(json.loads(raw)) if raw else ServiceConfig()
    app = create_app(config)
    from mrtr_keys.service.server import tune_gc

    tune_gc()
    return app
