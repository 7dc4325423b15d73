"""uvicorn's httptools protocol with connection limits.

**Limits** (`ConnectionLimits`, docs/sidecar.md "Connection limits"): a request head must arrive within
``header_timeout`` seconds of the connection opening or of its first byte, and be at most
``max_header_bytes`` long; a request body must arrive within ``body_timeout`` seconds of its head;
an idle kept-alive connection is closed after ``keep_alive_timeout`` (uvicorn's own timer). A connection
that stalls is closed (408 when it had sent part of a head); a head over the limit gets 431; a
connection opened while ``max_connections`` are open gets 503 ``{"error":"too_many_connections"}``. Those
answers are sent with ``Connection: close`` and a lingering close (our side shuts its writing half and
discards what still arrives for up to `LINGER_SECONDS`), so the client reads the answer instead of a
reset. Deadlines are checked by one sweep per `SWEEP_SECONDS` over the open connections (a request costs
two float stores, not a timer), so a stalled connection is closed within its timeout plus that.

Three more hold what uvicorn leaves open (issue 22): the **trailers** of a chunked body (and its chunk
framing beyond `CHUNK_ALLOWANCE` bytes a chunk) count against ``max_header_bytes`` as they stream in, and a
connection over it is closed (httptools buffers a trailer value whole, and uvicorn appends trailers to the
request's headers; they are dropped here, since ASGI has no request trailers); a response **write** that
makes no progress (the transport's buffer, above its high-water mark, shrinks by less than
`WRITE_PROGRESS_BYTES`) for ``write_timeout`` seconds aborts the connection and frees its buffer; and a
connection opened while ``max_connections_per_peer`` from the same address are open gets 503
``{"error":"too_many_connections_from_peer"}`` (a Unix socket has no peer address: only the global cap).

**One peer's flood costs the others nothing** (issue 39): the per-peer cap is checked first, and only
admitted connections count against ``max_connections``, so the surplus of a capped peer (thousands of
connections from one address) never makes another address's connection get ``too_many_connections``. A
refused connection lingers (above) only while fewer than `MAX_LINGERING` refusals do; beyond that it is
closed as soon as its answer is written, so a flood of refusals holds no more than that many descriptors
besides the admitted connections (`mrtr_keys.service.server.FD_RESERVE` is kept for them and the rest).

The hooks are the asyncio protocol methods and httptools' parser callbacks (``on_message_begin``,
``on_headers_complete``, ``on_message_complete``), which uvicorn's class implements; uvicorn is pinned to
the tested minor release in pyproject.toml and tests/service/test_protocol.py drives a real server.

The write-coalescing variant the sidecar runs by default is `mrtr_keys.service.corked`.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mrtr_keys.service.config import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_PEER,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_WRITE_TIMEOUT,
    ServiceConfig,
)

SWEEP_SECONDS = 0.5
"""How often deadlines are checked (seconds): a stalled connection lives at most its timeout plus this."""
LINGER_SECONDS = 2.0
"""How long a refused connection discards what the client still sends before it is closed (seconds)."""
MAX_DISCARD_BYTES = 1024 * 1024
"""A refused client sending more than this while we linger is cut off at once (bytes)."""
CHUNK_ALLOWANCE = 64
"""Bytes of framing a chunk may use (its size line and CRLFs) before the excess counts as head bytes."""
WRITE_PROGRESS_BYTES = 16 * 1024
"""How much a stalled response's buffer must shrink (bytes) to count as progress for ``write_timeout``."""
MAX_LINGERING = 64
"""Refused connections that may linger at once (per server); more are closed once their answer is written."""


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection limits of the sidecar's HTTP server (units: bytes, seconds, connections)."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER

    @classmethod
    def from_config(cls, config: ServiceConfig) -> ConnectionLimits:
        return cls(
            config.max_header_bytes,
            config.header_timeout,
            config.body_timeout,
            config.max_connections,
            config.write_timeout,
            config.max_connections_per_peer,
        )


def _response(status: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\nconnection: close\r\n\r\n"
        + body
    )


TOO_MANY = _response(b"503 Service Unavailable", b'{"error":"too_many_connections"}')
TOO_MANY_FROM_PEER = _response(b"503 Service Unavailable", b'{"error":"too_many_connections_from_peer"}')
HEAD_TOO_LARGE = _response(b"431 Request Header Fields Too Large", b'{"error":"header_too_large"}')
TIMED_OUT = _response(b"408 Request Timeout", b'{"error":"request_timeout"}')

_HEAD, _BODY, _APP = 0, 1, 2


def limits_of(app: Any) -> ConnectionLimits:
    """The `ConnectionLimits` an app carries (``connection_limits``, through wrapping middleware), or defaults."""
    for _ in range(8):
        limits = getattr(app, "connection_limits", None)
        if isinstance(limits, ConnectionLimits):
            return limits
        app = getattr(app, "app", None)
        if app is None:
            break
    return ConnectionLimits()


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` enforcing `ConnectionLimits` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limits = limits_of(self.app)
        self._phase = _HEAD
        self._deadline = math.inf
        self._head_bytes = 0
        self._begun = 0
        self._done = 0
        self._refused = False
        self._discarded = 0
        self._framing = 0  # bytes of a body phase that were not body (chunk framing, trailers)
        self._chunks = 0
        self._body_seen = 0
        self._write_deadline = math.inf
        self._write_mark = 0  # the send buffer's size at the last sweep
        self._write_progress = 0  # bytes it shrank by since the deadline was last set
        self._peer: str | None = None
        self._admitted = False  # counted in `_Counts.admitted` (against max_connections)
        self._lingering = False  # counted in `_Counts.lingering`

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        counts = _counts(self.server_state)
        peer = _peer_address(transport)
        if peer is not None and counts.peers.get(peer, 0) >= self._limits.max_connections_per_peer:
            # before the global cap, and before uvicorn's own set-up: a capped peer's surplus is neither
            # counted nor tracked (uvicorn's connection_lost copes with a connection it never saw made)
            self.transport = transport
            self._refuse(TOO_MANY_FROM_PEER)
            return
        super().connection_made(transport)
        if counts.admitted >= self._limits.max_connections:
            self._refuse(TOO_MANY)
            return
        counts.admitted += 1
        self._admitted = True
        if peer is not None:
            counts.peers[peer] = counts.peers.get(peer, 0) + 1
            self._peer = peer
        self._deadline = self.loop.time() + self._limits.header_timeout
        _Sweeper.watch(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._write_deadline = math.inf
        counts = _counts(self.server_state)
        if self._admitted:
            self._admitted = False
            counts.admitted -= 1
        if self._lingering:
            self._lingering = False
            counts.lingering -= 1
        peer, self._peer = self._peer, None
        if peer is not None:
            left = counts.peers.get(peer, 1) - 1
            if left > 0:
                counts.peers[peer] = left
            else:
                counts.peers.pop(peer, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # lingering after a refusal: discard, up to a bound
            self._discarded += len(data)
            if self._discarded > MAX_DISCARD_BYTES:
                self.transport.close()
            return
        done = self._done
        in_body = self._phase == _BODY
        self._body_seen = 0
        super().data_received(data)
        if in_body and self._phase == _BODY and not self._refused:
            # Still in one body: what was not body is framing or trailers, which httptools buffers.
            self._framing += len(data) - self._body_seen
            if self._framing - CHUNK_ALLOWANCE * self._chunks > self._limits.max_header_bytes:
                self._refused = True  # the app is reading this body: no answer of ours, just close
                self.transport.close()
        if self._phase == _HEAD and self._begun > self._done and not self._refused:
            # A head is pending: this whole chunk was head unless a message also ended in it (pipelining),
            # where the split is unknown and the next chunk counts (an overshoot of one read at most).
            self._head_bytes = self._head_bytes + len(data) if self._done == done else 0
            if self._head_bytes > self._limits.max_header_bytes:
                self._refuse(HEAD_TOO_LARGE)

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark: the write deadline starts."""
        super().pause_writing()
        self._write_mark = self.transport.get_write_buffer_size()
        self._write_progress = 0
        self._write_deadline = self.loop.time() + self._limits.write_timeout

    def resume_writing(self) -> None:
        """The buffer drained below its low-water mark: no write is pending."""
        super().resume_writing()
        self._write_deadline = math.inf

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = _HEAD
        self._begun += 1
        self._head_bytes = 0
        if self._deadline == math.inf:  # a kept-alive connection's next request (the first keeps its deadline)
            self._deadline = self.loop.time() + self._limits.header_timeout

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._phase == _HEAD:
            super().on_header(name, value)
        # else a trailer of a chunked body: counted in data_received, never added to the request's headers

    def on_chunk_header(self) -> None:
        self._chunks += 1

    def on_headers_complete(self) -> None:
        # a head that arrived within one read is measured here (URL and header lines, as sent)
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self._limits.max_header_bytes:
            self._refuse(HEAD_TOO_LARGE)
            return
        self._phase = _BODY
        self._head_bytes = 0
        self._framing = self._chunks = 0
        self._deadline = self.loop.time() + self._limits.body_timeout
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_seen += len(body)
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._phase = _APP
        self._done += 1
        self._deadline = math.inf
        super().on_message_complete()

    # ------------------------------------------------------------------ limits

    def _swept(self, now: float) -> bool:
        """One sweep of this connection: True when there is nothing left to watch (closed, or closed now)."""
        transport = self.transport
        if transport is None:
            return True
        if self._write_deadline != math.inf:  # a response is stuck in the buffer, even while closing
            return self._write_stalled(now)
        return transport.is_closing() or self._expired(now)

    def _expired(self, now: float) -> bool:
        """Close the connection if its head or body deadline passed; True if it did."""
        if now < self._deadline or self._refused or self.transport is None or self.transport.is_closing():
            return False
        partial_head = self._phase == _HEAD and self._begun > self._done
        responding = self.cycle is not None and not self.cycle.response_complete
        if partial_head and not responding:
            self._refuse(TIMED_OUT)
        else:  # nothing sent, a body cut short, or a response on its way: just close
            self.transport.close()
        return True

    def _write_stalled(self, now: float) -> bool:
        """Abort the connection (dropping its buffer) if a pending response made no progress for
        ``write_timeout``; the deadline moves on with every `WRITE_PROGRESS_BYTES` the client reads."""
        transport = self.transport
        size = transport.get_write_buffer_size()
        if size == 0 and transport.is_closing():
            return True  # gone (connection_lost) or flushed while closing: nothing left to watch
        self._write_progress += max(0, self._write_mark - size)  # what the client read (a later write adds)
        self._write_mark = size
        if self._write_progress >= WRITE_PROGRESS_BYTES:
            self._write_progress = 0
            self._write_deadline = now + self._limits.write_timeout
            return False
        if now < self._write_deadline:
            return False
        self._write_deadline = math.inf
        transport.abort()
        return True

    def _refuse(self, answer: bytes) -> None:
        """Answer `answer`, stop reading requests, shut our writing half, close after `LINGER_SECONDS` (at once
        when `MAX_LINGERING` refused connections linger already)."""
        self._refused = True
        self._deadline = math.inf
        transport = self.transport
        transport.write(answer)
        counts = _counts(self.server_state)
        if not self._lingering and counts.lingering < MAX_LINGERING and transport.can_write_eof():
            self._lingering = True
            counts.lingering += 1
            transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, transport.close)
        else:
            transport.close()


def _peer_address(transport: asyncio.BaseTransport) -> str | None:
    """The client's IP address, or None (a Unix socket)."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer and isinstance(peer[0], str):
        return peer[0]
    return None


class _Counts:
    """A server's connection counts (one worker, one loop): `admitted` (against ``max_connections``), `peers`
    (admitted by peer address, against ``max_connections_per_peer``), `lingering` (refused, not yet closed)."""

    __slots__ = ("admitted", "lingering", "peers")

    def __init__(self) -> None:
        self.admitted = 0
        self.lingering = 0
        self.peers: dict[str, int] = {}


def _counts(server_state: Any) -> _Counts:
    """The `_Counts` kept on uvicorn's per-server state."""
    counts: _Counts | None = getattr(server_state, "mrtr_counts", None)
    if counts is None:
        counts = server_state.mrtr_counts = _Counts()
    return counts


class _Sweeper:
    """One self-rescheduling check per event loop of every watched connection's deadline."""

    _running: dict[asyncio.AbstractEventLoop, _Sweeper] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.watched: set[LimitedHttpToolsProtocol] = set()

    @classmethod
    def watch(cls, protocol: LimitedHttpToolsProtocol) -> None:
        sweeper = cls._running.get(protocol.loop)
        if sweeper is None:
            sweeper = cls._running[protocol.loop] = _Sweeper(protocol.loop)
            protocol.loop.call_later(SWEEP_SECONDS, sweeper.sweep)
        sweeper.watched.add(protocol)

    def sweep(self) -> None:
        now = self.loop.time()
        for protocol in list(self.watched):
            if protocol._swept(now):
                self.watched.discard(protocol)
        if self.watched and not self.loop.is_closed():
            self.loop.call_later(SWEEP_SECONDS, self.sweep)
        else:
            self._running.pop(self.loop, None)
