"""OpenTelemetry spans for seal, unseal, reload, keystore reads and key ring changes.

Optional: spans need ``opentelemetry-api`` (the ``otel`` extra; the MCP SDK already depends on it)
and an SDK ``TracerProvider`` set by the application (`opentelemetry.trace.set_tracer_provider`).
Seal and unseal run inside the MCP SDK's own span for the message (``tools/call NAME``, from
`mcp.server._otel.OpenTelemetryMiddleware`), so ours are its children and a trace shows which
key sealed or refused a round.

Spans (kind INTERNAL, tracer ``mrtr-keys``) and attributes:

* ``mrtr_keys.seal`` / ``mrtr_keys.unseal``: ``mrtr_keys.codec``, ``mrtr_keys.audience``,
  ``mrtr_keys.kid``, ``mrtr_keys.outcome`` (``ok``, ``rejected``, ``error``), and on a refusal
  ``mrtr_keys.reason`` (the codec's short reason code, e.g. ``retired kid``; status ERROR);
* ``mrtr_keys.reload``: ``mrtr_keys.generation`` (before) and ``mrtr_keys.outcome``
  (``switched``, ``unchanged``, ``failed`` with ``mrtr_keys.reason`` = the error type);
* ``mrtr_keys.keystore.load``: ``mrtr_keys.keystore`` (its URL, which never holds a secret),
  ``mrtr_keys.generation`` read;
* ``mrtr_keys.ring.change``: ``mrtr_keys.op`` (``begin``, ``promote``, ``retire``, ``next``,
  ``abort``, ``destroy``, ``ttl``, ...), ``mrtr_keys.outcome`` (``changed``, ``unchanged``,
  ``refused``), ``mrtr_keys.generation`` written, ``mrtr_keys.kid`` (the key concerned),
  ``mrtr_keys.reason`` (``forced``, or the refusal's error type).

Never an attribute: payloads, tokens, secrets, key material, exception messages of backends.

Cost: when no tracer provider is set, a seal or unseal pays one Python call and one attribute
test on top of the codec (``make bench``, row "seal+unseal, OTel API, no provider").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

try:  # the `otel` extra (the MCP SDK depends on opentelemetry-api, so it is nearly always there)
    from opentelemetry import trace as _trace
    from opentelemetry.trace import SpanKind, StatusCode
except ImportError:  # pragma: no cover - exercised only without the API installed
    _trace = None  # type: ignore[assignment]

TRACER_NAME = "mrtr-keys"
_tracer: Any = None
_HAS_GLOBAL = _trace is not None and hasattr(_trace, "_TRACER_PROVIDER")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mrtr-keys")
    except Exception:
        return "0"


def tracer() -> Any:
    """The ``mrtr-keys`` tracer (a proxy until the application sets a provider), or None without the API."""
    global _tracer
    if _trace is None:
        return None
    if _tracer is None:
        _tracer = _trace.get_tracer(TRACER_NAME, _version())
    return _tracer


def active() -> bool:
    """True once the application has set a tracer provider (a few tens of nanoseconds when not)."""
    if _trace is None:
        return False
    if _HAS_GLOBAL:
        return _trace._TRACER_PROVIDER is not None  # type: ignore[attr-defined]
    return not isinstance(_trace.get_tracer_provider(), _trace.ProxyTracerProvider)


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Any]:
    """An INTERNAL span named `name` with ``mrtr_keys.*`` attributes (None values left out), or a
    no-op when tracing is off. Exceptions propagate; the span records only their type."""
    if not active():
        yield None
        return
    attrs = {f"mrtr_keys.{k}": v for k, v in attributes.items() if v is not None}
    with tracer().start_as_current_span(
        name, kind=SpanKind.INTERNAL, attributes=attrs, record_exception=False, set_status_on_exception=False
    ) as sp:
        try:
            yield sp
        except BaseException as exc:
            seen = getattr(sp, "attributes", None) or {}
            sp.set_attribute("mrtr_keys.outcome", seen.get("mrtr_keys.outcome", "error"))
            sp.set_attribute("mrtr_keys.reason", seen.get("mrtr_keys.reason", type(exc).__name__))
            sp.set_status(StatusCode.ERROR)
            raise


def set_attributes(sp: Any, **attributes: Any) -> None:
    """Add ``mrtr_keys.*`` attributes to `sp` (from `span`; None is a no-op)."""
    if sp is not None:
        sp.set_attributes({f"mrtr_keys.{k}": v for k, v in attributes.items() if v is not None})


def load_ring(keystore: Any) -> Any:
    """`keystore.load()` inside a ``mrtr_keys.keystore.load`` span (the keystore's URL, the generation read)."""
    if not active():
        return keystore.load()
    with span("mrtr_keys.keystore.load", keystore=getattr(keystore, "url", None)) as sp:
        ring = keystore.load()
        set_attributes(sp, generation=ring.generation, outcome="ok")
        return ring


def kid_of(token: object) -> str | None:
    """The kid (8 hex) of a ``PREFIX.`` + base64url(kid[4] || ...) token, or None; for span attributes
    only (the kid is public: it is in clear in every token)."""
    if not isinstance(token, str):
        return None
    dot = token.find(".", 0, 8)
    head = token[dot + 1 : dot + 9] if dot > 0 else ""
    if len(head) != 8:
        return None
    import base64
    import binascii

    try:
        return base64.urlsafe_b64decode(head)[:4].hex()
    except (binascii.Error, ValueError):
        return None


def traced_codec(
    codec: str, audience: str, kid: str | None, seal: Callable[[bytes], str], unseal: Callable[[str], bytes]
) -> tuple[Callable[[bytes], str], Callable[[str], bytes]]:
    """`seal` and `unseal` wrapped in ``mrtr_keys.seal`` / ``mrtr_keys.unseal`` spans while a tracer
    provider is set; without the API they are returned as they are."""
    if _trace is None:
        return seal, unseal

    api = _trace if _HAS_GLOBAL else None

    def traced_seal(payload: bytes) -> str:
        if (api._TRACER_PROVIDER is None) if api is not None else not active():  # type: ignore[attr-defined]
            return seal(payload)
        with span("mrtr_keys.seal", codec=codec, audience=audience, kid=kid) as sp:
            token = seal(payload)
            set_attributes(sp, outcome="ok", kid=kid or kid_of(token))
            return token

    def traced_unseal(token: str) -> bytes:
        if (api._TRACER_PROVIDER is None) if api is not None else not active():  # type: ignore[attr-defined]
            return unseal(token)
        from mcp.server.mcpserver import InvalidRequestState

        with span("mrtr_keys.unseal", codec=codec, audience=audience, kid=kid_of(token)) as sp:
            try:
                payload = unseal(token)
            except InvalidRequestState as exc:
                set_attributes(sp, outcome="rejected", reason=str(exc)[:64] or "rejected")
                raise
            set_attributes(sp, outcome="ok")
            return payload

    return traced_seal, traced_unseal
