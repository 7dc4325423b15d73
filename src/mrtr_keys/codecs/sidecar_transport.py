"""`sidecar_transport`: the httpx transport for a sidecar URL, without the MCP SDK.

Kept apart from `mrtr_keys.codecs.sidecar_client` so that ``mrtr-keys health`` (a Kubernetes exec
probe, a Docker HEALTHCHECK, run every few seconds under a 1 s default probe timeout) does not import
the MCP SDK: that import alone was most of the command's time.
"""

from __future__ import annotations

import functools
import ssl
from urllib.parse import unquote, urlparse

import httpx

from mrtr_keys.errors import ConfigError
from mrtr_keys.urls import redact


@functools.cache
def _unused_tls() -> ssl.SSLContext:
    """The context httpx requires of every transport, for the ones that never speak TLS (``http://``,
    ``unix://``): httpx's own default (certifi's CA bundle, verification on), built once per process instead
    of once per codec (loading the bundle costs about 35 ms of CPU)."""
    return httpx.create_ssl_context()


def sidecar_transport(url: str) -> tuple[str, httpx.HTTPTransport]:
    """``(base_url, transport)`` for a sidecar at ``http://host:port``, ``https://host:port`` or ``unix:///path``.

    The transport never retries (``retries=0``): a retry is the caller's decision. Used by `SidecarCodec` and
    by ``mrtr-keys health``.

    Raises:
        ConfigError: any other scheme, a Unix socket URL with a host or without a path, or a non-string.
    """
    if not isinstance(url, str):
        raise ConfigError("the sidecar URL must be a string")
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number from 0 to 65535
    except ValueError as exc:  # "http://[::1" (an unclosed IPv6 host), "http://host:abc"
        raise ConfigError(f"the sidecar URL {redact(url)!r} cannot be read: {exc}") from None
    if parsed.scheme == "unix":
        path = unquote(parsed.path)
        if parsed.netloc or not path:
            raise ConfigError("a Unix socket URL is unix:///absolute/path/to/sidecar.sock")
        return "http://sidecar", httpx.HTTPTransport(uds=path, retries=0, verify=_unused_tls())
    if parsed.scheme == "http" and parsed.hostname:
        return url.rstrip("/"), httpx.HTTPTransport(retries=0, verify=_unused_tls())
    if parsed.scheme == "https" and parsed.hostname:
        return url.rstrip("/"), httpx.HTTPTransport(retries=0)
    raise ConfigError(f"unsupported sidecar URL {redact(url)!r} (use http://HOST:PORT or unix:///PATH)")
