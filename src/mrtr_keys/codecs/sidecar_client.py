"""`SidecarCodec`: the MCP SDK's `RequestStateCodec` over the sealing sidecar's HTTP API.

The MCP server holds no key material: each `seal` is a ``POST /v1/seal`` and
each `unseal` a ``POST /v1/unseal`` to the sidecar (see docs/sidecar.md), over
one keep-alive connection pool (httpx, synchronous, as the SDK's codec contract
requires). URLs: ``http://HOST:PORT`` or ``unix:///path/to/sidecar.sock``.

Failures, kept apart on purpose:

* the sidecar refused the token (HTTP 400, or a token this side can already see
  is unusable: over `MAX_TOKEN_CHARS`, not text) -> `InvalidRequestState`, so the
  SDK answers with its one fixed rejection;
* the sidecar is unreachable, times out or answers 5xx -> `BackendUnavailable`
  (the token may be fine; the SDK fails closed with an internal error);
* the sidecar refuses *this client* (401, 403) or the request (413, 422 on seal)
  -> `ConfigError`: a deployment mistake (wrong secret, audience not granted).
"""

from __future__ import annotations

import logging
import os
from typing import Any, NoReturn

import httpx
import orjson
from mcp.server.mcpserver import InvalidRequestState, RequestStateSecurity

from mrtr_keys.codecs.sidecar_transport import sidecar_transport
from mrtr_keys.errors import BackendUnavailable, ConfigError, check_keywords, keywords_of
from mrtr_keys.token import MAX_TOKEN_CHARS, MalformedToken, b64u_decode, b64u_encode
from mrtr_keys.urls import redact

ENV_SECRET = "MRTR_KEYS_SIDECAR_SECRET"  # noqa: S105 - the variable's name
DEFAULT_TIMEOUT = 2.0
"""Seconds for a whole request (connect, write, read); the local sidecar answers in well under 1 ms."""
DEFAULT_CONNECT_TIMEOUT = 0.5

log = logging.getLogger("mrtr_keys.codecs.sidecar_client")


class SidecarCodec:
    """Seal and unseal through a sealing sidecar.

    Args:
        url: ``http://127.0.0.1:8750`` (loopback, or a pod-local address) or ``unix:///run/mrtr/sidecar.sock``.
        audience: the audience tokens are sealed for (usually the MCP server's name); the client must
            have been granted it (``mrtr-keys clients add NAME --audience AUDIENCE``).
        secret: the client's bearer secret (default: ``MRTR_KEYS_SIDECAR_SECRET``).
        timeout: seconds per request; connect_timeout: seconds to connect.

    Raises:
        ConfigError: bad URL, no secret, empty audience, non-positive timeout.
    """

    remote_per_token = True
    """Every `seal` and `unseal` is one HTTP request to the sidecar."""

    def __init__(
        self,
        url: str,
        *,
        audience: str,
        secret: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        if not isinstance(audience, str) or not audience:
            raise ConfigError("SidecarCodec needs a non-empty audience (usually the MCP server's name)")
        secret = secret if secret is not None else os.environ.get(ENV_SECRET)
        if not secret or not isinstance(secret, str) or not secret.isascii() or not secret.isprintable():
            raise ConfigError(
                f"SidecarCodec needs the client's secret (secret=... or {ENV_SECRET}); "
                "issue one with: mrtr-keys clients add NAME --audience AUDIENCE"
            )
        if not (timeout > 0 and connect_timeout > 0):
            raise ConfigError("SidecarCodec timeouts must be positive seconds")
        base, transport = sidecar_transport(url)
        self._url = redact(url)  # a password in the URL's userinfo never reaches repr() or a message
        self._audience = audience
        self._headers = {"authorization": f"Bearer {secret}", "content-type": "application/json"}
        self._client = httpx.Client(
            base_url=base,
            transport=transport,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            headers=self._headers,
        )
        from mrtr_keys.tracing import traced_codec

        self.seal, self.unseal = traced_codec("sidecar", audience, None, self.seal, self.unseal)  # type: ignore[method-assign, assignment]

    def __repr__(self) -> str:
        return f"SidecarCodec({self._url!r}, audience={self._audience!r})"

    @property
    def audience(self) -> str:
        return self._audience

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> SidecarCodec:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def seal(self, payload: bytes) -> str:
        """``POST /v1/seal``; returns the token.

        Raises:
            BackendUnavailable: sidecar unreachable, timed out or 5xx.
            ConfigError: the sidecar refused this client or request (401, 403, 413, 422).
        """
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError("payload must be bytes")
        status, doc = self._post("/v1/seal", {"audience": self._audience, "payload": b64u_encode(bytes(payload))})
        if status == 200 and isinstance(doc.get("token"), str):
            token: str = doc["token"]
            return token
        _refused(status, doc, "seal")

    def unseal(self, token: str) -> bytes:
        """``POST /v1/unseal``; returns the payload.

        Raises:
            InvalidRequestState: the sidecar rejected the token (one reason code, ``rejected``), or it is
                visibly unusable here (not text, over the length cap).
            BackendUnavailable: sidecar unreachable, timed out or 5xx.
            ConfigError: the sidecar refused this client (401, 403).
        """
        if not isinstance(token, str):
            raise InvalidRequestState("malformed")
        if len(token) > MAX_TOKEN_CHARS:
            raise InvalidRequestState("too long")
        try:
            body = {"audience": self._audience, "token": token}
            status, doc = self._post("/v1/unseal", body)
        except _Unencodable:
            raise InvalidRequestState("malformed") from None
        if status == 200 and isinstance(doc.get("payload"), str):
            try:
                return b64u_decode(doc["payload"])
            except MalformedToken:
                raise BackendUnavailable("the sidecar answered with a malformed payload") from None
        if status in (400, 413, 422):
            raise InvalidRequestState("rejected")
        _refused(status, doc, "unseal")

    def reload(self) -> bool:
        """Nothing to reload here: the sidecar picks up new rings itself. Returns False."""
        return False

    def describe(self) -> dict[str, Any]:
        """``GET /v1/keys``: the sidecar's ring (kids, states, generation, ttl_seconds); no material.

        Raises:
            BackendUnavailable, ConfigError: as for `seal`.
        """
        try:
            response = self._client.get("/v1/keys")
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"sidecar {self._url} unreachable: {type(exc).__name__}") from None
        doc = _json(response)
        if response.status_code == 200:
            return doc
        _refused(response.status_code, doc, "describe")

    def _post(self, path: str, body: dict[str, str]) -> tuple[int, dict[str, Any]]:
        try:
            content = orjson.dumps(body)
        except TypeError:  # lone surrogates in a str
            raise _Unencodable from None
        try:
            response = self._client.post(path, content=content)
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"sidecar {self._url} unreachable: {type(exc).__name__}") from None
        return response.status_code, _json(response)


class _Unencodable(Exception):
    pass


def _json(response: httpx.Response) -> dict[str, Any]:
    if response.status_code >= 500:
        raise BackendUnavailable(f"sidecar answered {response.status_code}")
    try:
        doc = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        raise BackendUnavailable(f"sidecar answered {response.status_code} with a body that is not JSON") from None
    return doc if isinstance(doc, dict) else {}


def _refused(status: int, doc: dict[str, Any], op: str) -> NoReturn:
    if status == 401:
        raise ConfigError("the sidecar refused this client's secret (401): check the secret given to SidecarCodec")
    if status == 403:
        raise ConfigError(
            f"the sidecar refused {op} for this audience (403): grant it with "
            "mrtr-keys clients add NAME --audience AUDIENCE --ops seal,unseal"
        )
    if status == 413:
        raise ConfigError("the sidecar refused the request as too large (413)")
    if status == 422:
        raise ConfigError(f"the sidecar refused the request (422): {doc.get('detail')}")
    raise BackendUnavailable(f"sidecar answered {status} to {op}")


def sidecar_security(
    url: str, *, audience: str, secret: str | None = None, ttl: float = 600.0, **options: Any
) -> RequestStateSecurity:
    """`RequestStateSecurity(codec=SidecarCodec(url, ...), audience=..., ttl=...)`.

    If the sidecar answers ``GET /v1/keys`` now, a refused secret (401) fails here and `ttl` is checked
    against the ring's TTL (the rotation gate relies on it); if it is not up yet (a sidecar container
    starting beside this one), the check is skipped and logged, and the codec connects on first use.

    Raises:
        ConfigError: bad URL or secret, a secret the running sidecar refuses, `ttl` longer than the
            ring's TTL, or a keyword `SidecarCodec` does not take (named with the closest one).
    """
    check_keywords(options, keywords_of(sidecar_security, SidecarCodec.__init__), "sidecar_security()")
    codec = SidecarCodec(url, audience=audience, secret=secret, **options)
    try:
        ring_ttl = codec.describe().get("ttl_seconds")
    except ConfigError:  # the sidecar is up and refuses this secret: fail now, not on a user's first call
        codec.close()
        raise
    except BackendUnavailable as exc:
        log.info("sidecar %s not checked at start (%s); the ttl check is skipped", redact(url), exc)
        ring_ttl = None
    if isinstance(ring_ttl, int | float) and ttl > ring_ttl:
        codec.close()
        from mrtr_keys.ring.model import server_ttl_too_long

        raise ConfigError(server_ttl_too_long(ttl, ring_ttl))
    return RequestStateSecurity(codec=codec, audience=audience, ttl=float(ttl))
