"""What one sidecar request or batch item comes to: the `Outcome`, the fixed error bodies, the audit seam.

Every route answers with a `Result` ``(status, body bytes, extra headers)``; one operation (a single
seal/unseal or one batch item) first becomes an `Outcome`, which carries what the answer, the metrics and
the audit event need. Statuses and bodies are the sidecar API's (docs/sidecar.md): 400
``invalid_token`` for every unseal failure, 401, 403, 413, 422 ``invalid_request`` with a ``detail``
naming the field (values are never echoed), 503, 500.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]
Result = tuple[int, bytes, Headers | None]
"""(HTTP status, JSON body, extra response headers or None)."""
Handler = Callable[[Scope, Receive], Awaitable[Result]]
Loc = tuple[str | int, ...]


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


class TooLarge(Exception):
    """The request body went over ``max_body_bytes`` while streaming in."""


class Disconnected(Exception):
    """The client went away before its body arrived: nothing to answer."""


class AuditFailed(Exception):
    """The audit sink failed with ``strict_audit`` on: the request is answered 503."""


class Rejected(Exception):
    """A codec raised the SDK's `InvalidRequestState`; `reason` is its log-only reason code."""

    def __init__(self, reason: str, kid: str | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kid = kid


@dataclass(slots=True)
class Outcome:
    """One operation's result: the answer (`status`, `body`) and what metrics and audit record."""

    outcome: str
    status: int
    body: dict[str, Any]
    audience: str | None = None
    kid: str | None = None
    reason: str | None = None
    token: str | None = None
    detail: list[dict[str, Any]] | None = field(default=None)


def dump(obj: Any) -> bytes:
    """Compact JSON (orjson)."""
    return orjson.dumps(obj)


UNAUTHORIZED: Result = (401, dump({"error": "unauthorized"}), [(b"www-authenticate", b'Bearer realm="mrtr-keys"')])
FORBIDDEN_BODY: dict[str, Any] = {"error": "forbidden"}
INVALID_TOKEN_BODY: dict[str, Any] = {"error": "invalid_token"}
UNAVAILABLE_BODY: dict[str, Any] = {"error": "backend_unavailable"}
INTERNAL_BODY: dict[str, Any] = {"error": "internal"}
INTERNAL: Result = (500, dump(INTERNAL_BODY), None)
AUDIT_FAILED: Result = (503, dump({"error": "audit_unavailable"}), None)


def invalid(loc: Loc, msg: str) -> Outcome:
    """A 422 outcome naming the field at `loc` (``["body", "payload"]``, ``["items", 2, "token"]``)."""
    return Outcome("invalid", 422, {"error": "invalid_request"}, detail=[{"loc": list(loc), "msg": msg}])


def forbidden(audience: str | None, reason: str) -> Outcome:
    return Outcome("forbidden", 403, FORBIDDEN_BODY, audience, reason=reason)


def loc_text(loc: list[Any]) -> str:
    """``["items", 2, "payload"]`` -> ``items[2].payload`` (``body`` dropped)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def single(out: Outcome) -> Result:
    """The answer to a single (non-batch) request."""
    if out.detail is not None:
        return out.status, dump({"error": "invalid_request", "detail": out.detail}), None
    return out.status, dump(out.body), None


def result_item(out: Outcome) -> dict[str, Any]:
    """One entry of a batch's ``results``: the single answer's body, or ``{error, detail}`` text."""
    if out.detail is not None:
        d = out.detail[0]
        return {"error": "invalid_request", "detail": f"{loc_text(d['loc'])}: {d['msg']}"}
    return out.body
