"""The sidecar's one request core: every seal/unseal route, whichever way the request came in.

`SidecarCore` turns an ASGI request (``scope``, ``receive``) into a `Result`; `respond` adds the one
exception policy (a vanished client gets nothing, anything unexpected a JSON 500). The hand-written fast
path (`mrtr_keys.service.app.SidecarApp.__call__`) and the FastAPI routes both call `respond` with the
same handler, so validation (`mrtr_keys.service.validation`), statuses, bodies, metrics and audit events
are the same on both (tests/service/test_parity.py).

In-memory codecs (local, KMS envelope, Vault data-key) run on the event loop: microseconds, no thread
hop; a codec that may call out per token (``inline`` False) runs in a worker thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import anyio
import anyio.to_thread

from mrtr_keys.backends import Codec
from mrtr_keys.codecs.fence import FENCED_OUT, FENCED_OUT_TOO_LONG, UNKNOWN_KID, FencedOutTooLong
from mrtr_keys.codecs.usage import OVER_BUDGET, over_budget
from mrtr_keys.errors import AudienceError, MrtrKeysError
from mrtr_keys.replay.service_guard import STORE_UNAVAILABLE
from mrtr_keys.service.auth import ClientAuth, bearer_secret
from mrtr_keys.service.clients import Client
from mrtr_keys.service.config import ServiceConfig
from mrtr_keys.service.outcomes import (
    AUDIT_FAILED,
    INTERNAL,
    INTERNAL_BODY,
    INVALID_TOKEN_BODY,
    UNAUTHORIZED,
    UNAVAILABLE_BODY,
    AuditFailed,
    AuditSink,
    Disconnected,
    Handler,
    Loc,
    Outcome,
    Receive,
    Rejected,
    Result,
    Scope,
    TooLarge,
    dump,
    forbidden,
    result_item,
    single,
)
from mrtr_keys.service.ratelog import RateLimitedLog
from mrtr_keys.service.readiness import RingLifecycle
from mrtr_keys.service.reload import RingState
from mrtr_keys.service.validation import batch_items, parse_object, seal_check, unseal_check
from mrtr_keys.token import b64u_encode

log = logging.getLogger("mrtr_keys.service")

_OUTSIDE_SCOPE = "audience outside the key ring"
STORE_THREADS = 32
"""Most single-use unseals waiting on the replay store at once (worker threads); more wait their turn."""
_REPLAY_UNAVAILABLE_BODY: dict[str, Any] = {"error": "replay_store_unavailable"}


async def respond(handler: Handler, scope: Scope, receive: Receive) -> Result | None:
    """Run `handler`; None when the client disconnected before its body arrived, a JSON 500 on a bug."""
    try:
        return await handler(scope, receive)
    except Disconnected:
        return None
    except Exception:
        log.exception("request failed")
        return INTERNAL


class SidecarCore(RingLifecycle):
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
        super().__init__(ring, auth, config, audit=audit)
        self._max_body = config.max_body_bytes
        self._rejected_log = RateLimitedLog(log, "rejected-unseal")
        self._audit_log = RateLimitedLog(log, "audit-failure", level=logging.WARNING)
        self._store_limiter: anyio.CapacityLimiter | None = None

    def _needs_store(self, op: str, client: Client, audience: str) -> bool:
        """True if this item calls the replay store (a single-use unseal): it then runs in a worker
        thread of `STORE_THREADS`, never on the event loop, so a silent store delays only the
        requests that need it (docs/single-use.md, issue 22)."""
        replay = self.replay
        return op == "unseal" and replay is not None and replay.applies(client.name, audience)

    def _store_threads(self) -> anyio.CapacityLimiter:
        if self._store_limiter is None:
            self._store_limiter = anyio.CapacityLimiter(STORE_THREADS)
        return self._store_limiter

    # ---------------------------------------------------------------- plumbing

    async def _read_body(self, receive: Receive) -> bytes:
        """The request body, refused (`TooLarge`) as soon as it exceeds the limit."""
        limit = self._max_body
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise Disconnected
            chunk: bytes = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise TooLarge
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

    def client_of(self, scope: Scope) -> Client | None:
        """The client whose bearer secret the request carries, or None."""
        return self._client(scope)

    def _client(self, scope: Scope) -> Client | None:
        secret = bearer_secret(scope["headers"])
        return None if secret is None else self.auth.authenticate(secret)

    def _record(self, op: str, client: Client | None, out: Outcome, t0: float, *, granted: bool) -> None:
        audience = out.audience if granted and out.audience is not None else "-"
        self.metrics.count(op, audience, out.outcome, 1)
        sink = self.audit
        if sink is not None:
            self._audit(sink, op, client.name if client is not None else None, out, t0)

    def _audit(self, sink: AuditSink, op: str, client: str | None, out: Outcome, t0: float) -> None:
        """One audit event; `AuditFailed` if the sink fails and audit is strict (one log line, no traceback)."""
        reason = out.reason
        if reason is None and out.outcome == "ok" and self.fence is not None and self.fence.error is not None:
            reason = FENCED_OUT  # served on the last good ring after a failed keystore check
        if reason is None and op == "seal" and out.kid in over_budget:
            reason = OVER_BUDGET  # sealed past the key's seal budget (sealing never stops)
        try:
            sink(
                op=op,
                audience=out.audience,
                client=client,
                kid=out.kid,
                outcome=out.outcome,
                reason=reason,
                token=out.token,
                duration_ms=(time.perf_counter() - t0) * 1000.0,
            )
        except Exception as exc:
            what = "request refused (strict_audit)" if self.strict_audit else "event lost"
            self._audit_log("audit sink failed, %s: %s: %s", what, type(exc).__name__, exc)
            if self.strict_audit:
                raise AuditFailed from None

    async def _pre(
        self, op: str, route: str, scope: Scope, receive: Receive, t0: float
    ) -> tuple[Client, dict[str, Any]] | Result:
        """413 / 401 / 403 (operation) / 422 (not a JSON object) checks shared by every POST route."""
        if self._declared_too_large(scope):
            return self._refuse(op, route, None, Outcome("too_large", 413, self._too_large_body()), t0)
        client = self._client(scope)
        if client is None:
            self._refuse(op, route, None, Outcome("unauthorized", 401, {}), t0)
            return UNAUTHORIZED
        if op not in client.ops:
            return self._refuse(op, route, client, forbidden(None, "operation"), t0)
        try:
            body = await self._read_body(receive)
        except TooLarge:
            return self._refuse(op, route, client, Outcome("too_large", 413, self._too_large_body()), t0)
        doc = parse_object(body)
        if isinstance(doc, Outcome):
            return self._refuse(op, route, client, doc, t0)
        return client, doc

    def _too_large_body(self) -> dict[str, Any]:
        return {"error": "body_too_large", "max_bytes": self._max_body}

    def _refuse(self, op: str, route: str, client: Client | None, out: Outcome, t0: float) -> Result:
        try:
            self._record(op, client, out, t0, granted=False)
        except AuditFailed:
            return AUDIT_FAILED
        self.metrics.observe(route, time.perf_counter() - t0)
        return single(out)

    # ---------------------------------------------------------------- items

    def _seal_with(self, codec: Codec, audience: str, payload: bytes, client: Client) -> Outcome:
        """Seal with `codec` (on the loop or in a worker thread), mapping every failure to an outcome."""
        try:
            token, kid = self._call(codec.seal, payload)
        except AudienceError:
            return forbidden(audience, _OUTSIDE_SCOPE)
        except MrtrKeysError as exc:
            log.warning("seal failed (audience=%r): %s", audience, exc)
            return Outcome("unavailable", 503, UNAVAILABLE_BODY, audience, reason=type(exc).__name__)
        except Rejected as exc:  # a codec refusing to seal: treat as a server fault
            log.error("seal refused by the codec (audience=%r): %s", audience, exc.reason)
            return Outcome("error", 500, INTERNAL_BODY, audience, reason=exc.reason)
        except Exception:
            log.exception("seal failed (audience=%r)", audience)
            return Outcome("error", 500, INTERNAL_BODY, audience, reason="internal")
        return Outcome("ok", 200, {"token": token, "kid": kid}, audience, kid, None, token)

    def _unseal_with(self, codec: Codec, audience: str, token: str, client: Client) -> Outcome:
        """Unseal with `codec` (on the loop or in a worker thread), mapping every failure to an outcome."""
        try:
            payload, kid = self._call(codec.unseal, token)
        except Rejected as exc:
            self._rejected_log(
                "unseal rejected (audience=%r client=%s kid=%s): %s", audience, client.name, exc.kid, exc.reason
            )
            return Outcome("rejected", 400, INVALID_TOKEN_BODY, audience, exc.kid, exc.reason, token)
        except AudienceError:
            return forbidden(audience, _OUTSIDE_SCOPE)
        except MrtrKeysError as exc:
            log.warning("unseal failed (audience=%r): %s", audience, exc)
            return Outcome("unavailable", 503, UNAVAILABLE_BODY, audience, reason=type(exc).__name__, token=token)
        except Exception:
            log.exception("unseal failed (audience=%r)", audience)
            return Outcome("error", 500, INTERNAL_BODY, audience, reason="internal", token=token)
        replay = self.replay
        if replay is not None and replay.applies(client.name, audience):
            refusal = replay.check(token, payload)  # single-use (docs/single-use.md)
            if refusal == STORE_UNAVAILABLE:
                return Outcome("unavailable", 503, _REPLAY_UNAVAILABLE_BODY, audience, kid, refusal, token)
            if refusal is not None:
                self._rejected_log(
                    "unseal rejected (audience=%r client=%s kid=%s): %s", audience, client.name, kid, refusal
                )
                return Outcome("rejected", 400, INVALID_TOKEN_BODY, audience, kid, refusal, token)
        return Outcome("ok", 200, {"payload": b64u_encode(payload), "kid": kid}, audience, kid, None, token)

    async def _open_codec(self, op: str, audience: str, token: str | None) -> Codec | Outcome:
        """The codec for `audience` when it is not built yet (opening may do I/O: worker thread)."""
        try:
            return await self._codec(audience)
        except AudienceError:
            return forbidden(audience, _OUTSIDE_SCOPE)
        except MrtrKeysError as exc:
            log.warning("%s failed (audience=%r): %s", op, audience, exc)
            return Outcome("unavailable", 503, UNAVAILABLE_BODY, audience, reason=type(exc).__name__, token=token)
        except Exception:
            log.exception("%s failed (audience=%r)", op, audience)
            return Outcome("error", 500, INTERNAL_BODY, audience, reason="internal", token=token)

    async def _item(self, op: str, client: Client, item: object, loc: Loc) -> Outcome:
        """One seal or unseal item, start to end (awaits only to open a codec, run a remote one, or check the
        keystore: the lease ran out, or an unseal met an unknown kid and the ring is looked at once more)."""
        refusal = await self._fence_refusal(op)
        if refusal is not None:
            return refusal
        generation = self.ring.ring.generation
        out = await self._item_once(op, client, item, loc)
        if op == "unseal" and out.reason == UNKNOWN_KID and await self._look_again(generation):
            out = await self._item_once(op, client, item, loc)
        return out

    async def _fence_refusal(self, op: str) -> Outcome | None:
        """The lease check (`RingLifecycle._fenced`); a 503 outcome once the sidecar has served fenced out for
        ``--max-fenced-out`` (`mrtr_keys.codecs.fence.FencedOutTooLong`), else None."""
        try:
            await self._fenced()
        except FencedOutTooLong as exc:
            log.warning("%s refused: %s", op, exc)
            return Outcome("unavailable", 503, UNAVAILABLE_BODY, reason=FENCED_OUT_TOO_LONG)
        return None

    async def _item_once(self, op: str, client: Client, item: object, loc: Loc) -> Outcome:
        """One seal or unseal item on the current snapshot."""
        if op == "seal":
            checked: tuple[str, Any] | Outcome = seal_check(client, item, loc)
            with_codec = self._seal_with
        else:
            checked = unseal_check(client, item, loc)
            with_codec = self._unseal_with  # type: ignore[assignment]
        if isinstance(checked, Outcome):
            return checked
        audience, value = checked
        codec = self.ring.snapshot.codecs.get(audience)
        if codec is None:
            opened = await self._open_codec(op, audience, value if op == "unseal" else None)
            if isinstance(opened, Outcome):
                return opened
            codec = opened
        if self._needs_store(op, client, audience):
            limiter = self._store_threads()
            return await anyio.to_thread.run_sync(with_codec, codec, audience, value, client, limiter=limiter)
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
        except AuditFailed:
            return AUDIT_FAILED
        self.metrics.observe(route, time.perf_counter() - t0)
        return single(out)

    async def _batch(self, op: str, route: str, scope: Scope, receive: Receive) -> Result:
        t0 = time.perf_counter()
        pre = await self._pre(op, route, scope, receive, t0)
        if isinstance(pre[0], int):
            return pre  # type: ignore[return-value]
        client, doc = pre  # type: ignore[misc]
        items = batch_items(doc, self.config.max_batch_items)
        if isinstance(items, Outcome):
            return self._refuse(op, route, client, items, t0)
        try:
            if self.ring.inline and not (op == "unseal" and self.replay is not None):
                results = await self._batch_inline(op, client, items, t0)
            else:
                results = []
                for i, item in enumerate(items):
                    out = await self._item(op, client, item, ("items", i))
                    self._record(op, client, out, t0, granted=out.outcome not in ("forbidden", "invalid"))
                    results.append(result_item(out))
        except AuditFailed:
            return AUDIT_FAILED
        self.metrics.observe(route, time.perf_counter() - t0)
        return 200, dump({"results": results}), None

    async def _batch_inline(self, op: str, client: Client, items: list[Any], t0: float) -> list[dict[str, Any]]:
        """The batch loop for in-memory codecs: no coroutine, thread hop or metrics lookup per item.

        Same results, audit events and counts as running `_item` per item: each item is checked,
        sealed or unsealed on the loop, audited, and counted (counters added once per batch).
        """
        refusal = await self._fence_refusal(op)
        fence = self.fence
        fenced = FENCED_OUT if fence is not None and fence.error is not None else None  # the ok events' reason
        seal = op == "seal"
        check = seal_check if seal else unseal_check
        with_codec = self._seal_with if seal else self._unseal_with
        codecs = self.ring.snapshot.codecs
        sink = self.audit
        # Not strict: the batch's events are queued together at the end (one lock); strict checks
        # the writer before each item, so a refused item stops the batch.
        many = None if sink is None or self.strict_audit else getattr(sink, "record_many", None)
        events: list[tuple[Any, ...]] = []
        clock, wall = time.perf_counter, time.time
        name = client.name
        tally: dict[tuple[str, str], int] = {}
        results: list[dict[str, Any]] = []
        append = results.append
        try:
            for i, item in enumerate(items):
                checked = check(client, item, ("items", i))
                if isinstance(checked, Outcome):
                    out = checked
                elif refusal is not None:
                    out = replace(refusal, audience=checked[0])
                else:
                    audience, value = checked
                    codec = codecs.get(audience)
                    if codec is None:
                        out = await self._item(op, client, item, ("items", i))
                    else:
                        generation = self.ring.ring.generation
                        out = with_codec(codec, audience, value, client)  # type: ignore[arg-type]
                        if out.reason == UNKNOWN_KID and await self._look_again(generation):
                            codecs = self.ring.snapshot.codecs
                            out = await self._item_once(op, client, item, ("items", i))
                outcome = out.outcome
                key = (
                    out.audience if outcome not in ("forbidden", "invalid") and out.audience is not None else "-",
                    outcome,
                )
                tally[key] = tally.get(key, 0) + 1
                if many is not None:
                    ms = (clock() - t0) * 1000.0
                    reason = out.reason if out.reason is not None or outcome != "ok" else fenced
                    if reason is None and seal and out.kid in over_budget:
                        reason = OVER_BUDGET
                    events.append((out.audience, out.kid, outcome, reason, out.token, ms, wall()))
                elif sink is not None:
                    self._audit(sink, op, name, out, t0)
                append(out.body if out.detail is None else result_item(out))
        finally:
            count = self.metrics.count
            for (audience, outcome), n in tally.items():
                count(op, audience, outcome, n)
            if events:
                self._audit_many(many, op, name, events)
        return results

    def _audit_many(self, many: Any, op: str, client: str, events: list[tuple[Any, ...]]) -> None:
        """A batch's events at once (not strict: a failure loses them, with one log line)."""
        try:
            many(op, client, events)
        except Exception as exc:
            self._audit_log("audit sink failed, %d events lost: %s: %s", len(events), type(exc).__name__, exc)

    async def seal(self, scope: Scope, receive: Receive) -> Result:
        return await self._one("seal", "/v1/seal", scope, receive)

    async def unseal(self, scope: Scope, receive: Receive) -> Result:
        return await self._one("unseal", "/v1/unseal", scope, receive)

    async def seal_batch(self, scope: Scope, receive: Receive) -> Result:
        return await self._batch("seal", "/v1/seal/batch", scope, receive)

    async def unseal_batch(self, scope: Scope, receive: Receive) -> Result:
        return await self._batch("unseal", "/v1/unseal/batch", scope, receive)

    def routes(self) -> dict[str, Handler]:
        """The four POST routes, path -> handler (the fast path's table and the FastAPI routes' handlers)."""
        return {
            "/v1/seal": self.seal,
            "/v1/unseal": self.unseal,
            "/v1/seal/batch": self.seal_batch,
            "/v1/unseal/batch": self.unseal_batch,
        }

    def keys(self, scope: Scope) -> Result:
        if self._client(scope) is None:
            return UNAUTHORIZED
        return 200, dump(self.describe()), None
