"""Single-use requestState: the first successful unseal of a token consumes it, fleet-wide.

The MCP spec (2026-07-28) binds a requestState to a time window, a request and a principal, and says
these do not by themselves make it single-use: where a flow needs that, the server must enforce it.
`ReplayGuard.check` does, right after a codec has authenticated a token:

1. The payload is the SDK's claims envelope (``{"v","iat","exp","m","t","a","s",...}``, built by
   `RequestStateBoundary._seal`). If `only` names targets and the envelope's target ``t`` is not one
   of them, nothing happens (today's behaviour). A payload that is not an envelope is always guarded.
2. A token whose ``exp`` has passed is refused here (``expired``), never recorded: the SDK refuses it
   anyway, and refusing here keeps an instance whose clock is behind from taking it unrecorded.
3. The id HMAC-SHA256(fleet key, prefix || decoded token bytes)[:16] is recorded in the store with a
   lifetime of ``exp + 60 s - now`` (60 s: the SDK's future-skew allowance, `_FUTURE_SKEW`); without
   an ``exp`` (a payload that is not an envelope), `fallback_ttl + 60 s`. The first recorder wins;
   everyone else gets ``replayed``.
4. If the store fails: ``on_store_error="deny"`` (default) refuses the round (`ReplayStoreUnavailable`);
   ``"allow"`` serves it unrecorded. Either way one counter and the store's health record it.

`SingleUseCodec` wraps any codec with a guard for `RequestStateSecurity(codec=...)`; the sidecar calls
`check` itself. See docs/single-use.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any, Literal

import orjson
from cryptography.hazmat.primitives import hashes, hmac
from mcp.server.mcpserver import InvalidRequestState
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from mrtr_keys.codecs.aesgcm import reject
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.errors import ConfigError, ReplayStoreUnavailable
from mrtr_keys.replay.store import ID_BYTES, ReplayStore
from mrtr_keys.token import MalformedToken, b64u_decode

FUTURE_SKEW_SECONDS = 60.0
"""The MCP SDK accepts tokens minted up to 60 s in the future (`_FUTURE_SKEW` in request_state.py), so a
fleet tolerates that much clock difference; a record outlives its token's ``exp`` by as much."""
OUTCOMES = ("consumed", "replayed", "expired", "skipped", "store_error_denied", "store_error_allowed")
StoreErrorPolicy = Literal["deny", "allow"]


class ReplayMetrics:
    """``mrtr_keys_single_use_total{outcome}`` (one of `OUTCOMES`) in `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        counter = Counter(
            "mrtr_keys_single_use", "Single-use requestState checks by outcome.", ("outcome",), registry=registry
        )
        self.children = {outcome: counter.labels(outcome) for outcome in OUTCOMES}

    def count(self, outcome: str) -> None:
        self.children[outcome].inc()


_default_metrics: ReplayMetrics | None = None
_metrics_lock = threading.Lock()


def default_metrics() -> ReplayMetrics:
    """The process-wide counters in prometheus-client's default registry (created once)."""
    global _default_metrics
    with _metrics_lock:
        if _default_metrics is None:
            _default_metrics = ReplayMetrics(REGISTRY)
        return _default_metrics


class Targets:
    """Which rounds are single-use: tool and prompt names, resource URIs or URI templates (RFC 6570).

    Matched against the envelope's ``t`` claim (the name for ``tools/call`` / ``prompts/get``, the URI
    for ``resources/read``); an entry with ``{`` is a template, matched with the SDK's `UriTemplate`.

    Raises:
        ConfigError: not a collection of non-empty strings, or a template the SDK cannot parse.
    """

    def __init__(self, names: Iterable[str]) -> None:
        if isinstance(names, str) or not isinstance(names, Iterable):
            raise ConfigError('single_use_for must be a set of names, e.g. {"approve_payment"}')
        entries = list(names)
        if not entries or not all(isinstance(n, str) and n for n in entries):
            raise ConfigError("single_use_for must name at least one tool, prompt or resource (non-empty strings)")
        self.names = frozenset(n for n in entries if "{" not in n)
        self._templates: list[Any] = []
        templates = [n for n in entries if "{" in n]
        if templates:
            from mcp.shared.uri_template import UriTemplate

            for text in templates:
                try:
                    self._templates.append(UriTemplate.parse(text))
                except Exception as exc:
                    raise ConfigError(f"single_use_for: {text!r} is not a URI template: {exc}") from None

    def covers(self, method: object, target: object) -> bool:
        if not isinstance(target, str):
            return True  # cannot tell: guard it
        if target in self.names:
            return True
        if method == "resources/read":
            return any(t.match(target) is not None for t in self._templates)
        return False


def token_bytes(token: str) -> bytes:
    """The bytes a token stands for: its prefix (through the last ``.``) and its decoded body.

    Our codecs accept only canonical base64url, so this is one-to-one with the accepted text; a
    token of another shape is taken as its UTF-8 text.
    """
    prefix, dot, body = token.rpartition(".")
    if dot:
        try:
            return prefix.encode("ascii") + b"." + b64u_decode(body)
        except (MalformedToken, UnicodeEncodeError):
            pass
    return token.encode("utf-8", "surrogatepass")


class ReplayGuard:
    """Consume-once check for unsealed tokens (see the module docstring).

    Args:
        store: the shared `ReplayStore`.
        only: limit to these targets (`Targets` or names); None guards every round.
        on_store_error: ``"deny"`` (fail closed, default) or ``"allow"``.
        fallback_ttl: seconds a token without an ``exp`` claim may live (the SDK / ring TTL).
        metrics: counters (default: the process-wide ones).

    Raises:
        ConfigError: a bad `on_store_error`, `fallback_ttl` or `only`.
    """

    def __init__(
        self,
        store: ReplayStore,
        *,
        only: Targets | Iterable[str] | None = None,
        on_store_error: StoreErrorPolicy = "deny",
        fallback_ttl: float,
        metrics: ReplayMetrics | None = None,
    ) -> None:
        if on_store_error not in ("deny", "allow"):
            raise ConfigError('on_store_error must be "deny" (fail closed) or "allow"')
        if isinstance(fallback_ttl, bool) or not isinstance(fallback_ttl, int | float) or not fallback_ttl > 0:
            raise ConfigError("the single-use fallback TTL must be a positive number of seconds")
        self.store = store
        self.only = only if only is None or isinstance(only, Targets) else Targets(only)
        self.allow_on_error = on_store_error == "allow"
        self._fallback_ms = (float(fallback_ttl) + FUTURE_SKEW_SECONDS) * 1000.0
        self.metrics = metrics if metrics is not None else default_metrics()
        self._mac: hmac.HMAC | None = None

    def __repr__(self) -> str:
        return f"ReplayGuard(store={self.store.url!r}, only={self.only is not None}, allow={self.allow_on_error})"

    def set_fallback_ttl(self, seconds: float) -> None:
        """Change the lifetime used for payloads without ``exp`` (the sidecar follows the ring's TTL)."""
        self._fallback_ms = (float(seconds) + FUTURE_SKEW_SECONDS) * 1000.0

    def token_id(self, token: str) -> bytes:
        """HMAC-SHA256(fleet key, `token_bytes(token)`) truncated to `ID_BYTES` (the store's record name).

        Raises:
            ReplayStoreUnavailable: the fleet key cannot be read from the store yet.
        """
        mac = self._mac
        if mac is None:
            mac = self._mac = hmac.HMAC(self.store.hmac_key(), hashes.SHA256())
        h = mac.copy()
        h.update(token_bytes(token))
        return h.finalize()[:ID_BYTES]

    def check(self, token: str, payload: bytes) -> None:
        """Consume `token` (already authenticated by a codec, unsealed to `payload`) or refuse it.

        Raises:
            InvalidRequestState: ``replayed`` (consumed before, anywhere in the fleet) or ``expired``.
            ReplayStoreUnavailable: the store failed and `on_store_error` is ``"deny"``.
        """
        count = self.metrics.count
        claims = _claims(payload)
        if claims is not None and self.only is not None and not self.only.covers(claims.get("m"), claims.get("t")):
            count("skipped")
            return
        exp = claims.get("exp") if claims is not None else None
        if isinstance(exp, int | float) and not isinstance(exp, bool):
            now = time.time()
            if not now < exp:  # stated positively: a NaN exp is refused too
                count("expired")
                reject("expired")
            ttl_ms = (exp + FUTURE_SKEW_SECONDS - now) * 1000.0
        else:
            ttl_ms = self._fallback_ms
        try:
            fresh = self.store.consume(self.token_id(token), max(1, int(ttl_ms) + 1))
        except ReplayStoreUnavailable:
            if self.allow_on_error:
                count("store_error_allowed")
                return
            count("store_error_denied")
            raise
        if not fresh:
            count("replayed")
            reject("replayed")
        count("consumed")

    def ready(self) -> bool:
        """True if the store answers now (readiness: degraded while it does not)."""
        return self.store.ping()


def _claims(payload: bytes) -> dict[str, Any] | None:
    """The SDK's claims envelope in `payload`, or None if it is not one."""
    if not payload.startswith(b"{"):
        return None
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


class DeferredObserver:
    """A `CodecObserver` for the codec inside a `SingleUseCodec`: passes every call through except
    `unsealed`, which it holds (per thread) until the guard has decided, so the audit log records the
    final outcome of an unseal (``ok``, or ``rejected`` with ``replayed``...) as one event."""

    def __init__(self, observer: CodecObserver) -> None:
        self.observer = observer
        self._held = threading.local()

    def __getattr__(self, name: str) -> Any:  # anything else the wrapped observer offers (its sink, ...)
        return getattr(self.observer, name)

    def ring_loaded(self, generation: int, kid: str | None = None) -> None:
        self.observer.ring_loaded(generation, kid)

    def sealed(self, kid: str, token: str) -> None:
        self.observer.sealed(kid, token)

    def unsealed(self, kid: str, token: str) -> None:
        self._held.kid = kid

    def rejected(self, kid: str | None, token: str, reason: str) -> None:
        self.observer.rejected(kid, token, reason)

    def take(self) -> str | None:
        """The kid of this thread's held unseal (and forget it), or None."""
        kid: str | None = getattr(self._held, "kid", None)
        self._held.kid = None
        return kid


class SingleUseCodec:
    """A codec whose `unseal` consumes each token once (any codec inside: local, KMS, Vault, sidecar).

    Drop-in for ``RequestStateSecurity(codec=...)``; `mrtr_keys.request_state_security(single_use=...)`
    builds it. `seal` is the inner codec's. A store failure under ``on_store_error="deny"`` is the
    reason ``replay store unavailable`` (the SDK logs one line and answers -32602). Every other
    attribute (``ring``, ``reload``, ``generation``...) is the inner codec's. If the inner codec was
    built with a `DeferredObserver` (`observer`), each unseal is reported to it once decided.
    """

    def __init__(self, inner: Any, guard: ReplayGuard, *, observer: DeferredObserver | None = None) -> None:
        self.inner = inner
        self.guard = guard
        self.observer = observer

    def __repr__(self) -> str:
        return f"SingleUseCodec({self.inner!r}, {self.guard!r})"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def seal(self, payload: bytes) -> str:
        token: str = self.inner.seal(payload)
        return token

    def unseal(self, token: str) -> bytes:
        """The inner codec's `unseal`, then `ReplayGuard.check`.

        Raises:
            InvalidRequestState: whatever the inner codec raises; ``replayed``, ``expired``, or
                ``replay store unavailable`` (fail closed).
        """
        payload: bytes = self.inner.unseal(token)
        observer = self.observer
        kid = observer.take() if observer is not None else None
        try:
            self.guard.check(token, payload)
        except InvalidRequestState as exc:
            if observer is not None and kid is not None:
                observer.rejected(kid, token, str(exc))
            raise
        except ReplayStoreUnavailable:
            if observer is not None and kid is not None:
                observer.rejected(kid, token, "replay store unavailable")
            reject("replay store unavailable")
        if observer is not None and kid is not None:
            observer.observer.unsealed(kid, token)
        return payload

    def ready(self) -> bool:
        """True if the replay store answers now (and the inner codec's own `ready`, if it has one)."""
        inner_ready = getattr(self.inner, "ready", None)
        return self.guard.ready() and (inner_ready is None or bool(inner_ready()))

    def close(self) -> None:
        """Close the store and the inner codec (if it has `close`)."""
        self.guard.store.close()
        inner_close = getattr(self.inner, "close", None)
        if inner_close is not None:
            inner_close()
