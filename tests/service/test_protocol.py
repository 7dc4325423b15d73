"""The sidecar's HTTP protocol against a real uvicorn server on loopback.

`CorkedHttpToolsProtocol` (`mrtr_keys.service.corked`) subclasses uvicorn's private httptools protocol and
wraps its transport, so these tests pin what it must keep doing whatever uvicorn release is installed
(pyproject.toml bounds it to the tested minor): bytes leave in order and whole, ``close`` flushes, pipelined
requests are answered in order, and the connection limits close or refuse what they must. Each test runs
against both protocol choices (``http = "corked"`` and ``"httptools"``). The server runs in a thread of this
process on a socket bound to port 0 and handed to uvicorn (no port to lose); clients are raw sockets.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mrtr_keys.service.protocol import ConnectionLimits
from tests.support.asgi import BOUND, ThreadedServer, read_body


class App:
    """An ASGI app: ``/stream`` answers in three body messages across loop iterations; else echoes the path."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.connection_limits = limits

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        if body is None:
            return
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"9")]})
            await send({"type": "http.response.body", "body": b"one", "more_body": True})
            await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": b"two", "more_body": True})
            await send({"type": "http.response.body", "body": b"333"})
            return
        out = scope["path"].encode() + b":" + body
        headers = [(b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})


class Server(ThreadedServer):
    def __init__(self, http: str, limits: ConnectionLimits) -> None:
        super().__init__(App(limits), http, timeout_keep_alive=30)


@pytest.fixture(params=["corked", "httptools"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    limits = getattr(request, "param_limits", None) or ConnectionLimits()
    s = Server(request.param, limits)
    try:
        yield s
    finally:
        s.stop()


def _limited(http: str, **limits: Any) -> Server:
    return Server(http, ConnectionLimits(**limits))


def read_all(s: socket.socket) -> bytes:
    """Everything until the peer closes (bounded by the socket timeout)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def read_responses(s: socket.socket, n: int) -> list[bytes]:
    """`n` Content-Length framed responses, as (head + body) bytes."""
    buf, out = b"", []
    while len(out) < n:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = buf[:end].lower()
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(buf) >= end + 4 + length:
                out.append(buf[: end + 4 + length])
                buf = buf[end + 4 + length :]
                continue
        chunk = s.recv(65536)
        assert chunk, f"closed after {len(out)} responses"
        buf += chunk
    return out


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: t\r\n{extra}\r\n".encode()


def test_status_headers_and_body_leave_in_order_and_whole(server: Server) -> None:
    """Bodies sent in one loop iteration or in several arrive after the head, in order, nothing lost."""
    with server.connect() as s:
        s.sendall(get("/stream"))
        (response,) = read_responses(s, 1)
    assert response.startswith(b"HTTP/1.1 200 OK\r\n")
    assert response.endswith(b"\r\n\r\nonetwo333")


def test_close_flushes_what_was_written(server: Server) -> None:
    """``Connection: close`` makes uvicorn close right after its last write: the whole answer still arrives."""
    with server.connect() as s:
        s.sendall(get("/last", "connection: close\r\n"))
        data = read_all(s)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b"\r\n\r\n/last:")
    assert b"connection: close" in data.lower()


def test_pipelined_requests_are_answered_in_order(server: Server) -> None:
    """Three requests in one write: three answers, in request order, on one connection."""
    with server.connect() as s:
        s.sendall(get("/a") + b"POST /b HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\n\r\nbody" + get("/c"))
        answers = read_responses(s, 3)
    assert [a.rsplit(b"\r\n\r\n", 1)[1] for a in answers] == [b"/a:", b"/b:body", b"/c:"]


@pytest.mark.parametrize("http", ["corked", "httptools"])
def test_stalled_connections_are_closed(http: str) -> None:
    """Nothing sent, a partial head, a short body, an unfinished chunked body: each closed.

    A partial head gets 408; the others are just closed (a body cut short has no one to answer)."""
    server = _limited(http, header_timeout=0.3, body_timeout=0.3)
    try:
        silent, partial, short, chunked = (server.connect() for _ in range(4))
        partial.sendall(b"POST /x HTTP/1.1\r\nhost: t\r\nx-slow: ")
        short.sendall(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n0123456789")
        chunked.sendall(b"POST /x HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        assert read_all(silent) == b""
        answer = read_all(partial)
        assert answer.startswith(b"HTTP/1.1 408 ") and answer.endswith(b'{"error":"request_timeout"}')
        assert read_all(short) == b""
        assert read_all(chunked) == b""
        with server.connect() as fresh:  # the server is fine
            fresh.sendall(get("/ok"))
            assert read_responses(fresh, 1)[0].endswith(b"/ok:")
        for s in (silent, partial, short, chunked):
            s.close()
    finally:
        server.stop()


@pytest.mark.parametrize("http", ["corked", "httptools"])
def test_a_kept_alive_connection_gets_a_fresh_head_deadline_per_request(http: str) -> None:
    server = _limited(http, header_timeout=0.5)
    try:
        with server.connect() as s:
            for i in range(3):
                time.sleep(0.2)
                s.sendall(get(f"/{i}"))
                assert read_responses(s, 1)[0].endswith(f"/{i}:".encode())
    finally:
        server.stop()


@pytest.mark.parametrize("http", ["corked", "httptools"])
def test_a_head_over_the_limit_is_431_and_others_are_served_meanwhile(http: str) -> None:
    """A huge header is refused after the first read over the limit, not parsed to its end."""
    server = _limited(http, max_header_bytes=8192)
    try:
        big = server.connect()
        big.sendall(b"GET / HTTP/1.1\r\nhost: t\r\nx-big: ")
        sender_error: list[BaseException] = []

        def flood() -> None:
            try:
                for _ in range(100):  # up to 100 MB, stopped by the server
                    big.sendall(b"a" * (1 << 20))
            except OSError as exc:
                sender_error.append(exc)

        t = threading.Thread(target=flood, daemon=True)
        t.start()
        with server.connect() as other:
            other.sendall(get("/other"))
            assert read_responses(other, 1)[0].endswith(b"/other:")
        t.join(BOUND)
        assert not t.is_alive() and sender_error, "the server kept reading a 100 MB header"
        answer = b""
        try:
            answer = read_all(big)
        except OSError:
            pass  # the 431 may be lost to a reset once the flood is cut off
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 ")
        big.close()
        with server.connect() as s:  # a head just under the limit is fine
            s.sendall(get("/fine", "x-pad: " + "p" * 7000 + "\r\n"))
            assert read_responses(s, 1)[0].endswith(b"/fine:")
    finally:
        server.stop()


@pytest.mark.parametrize("http", ["corked", "httptools"])
def test_a_head_over_the_limit_gets_its_431(http: str) -> None:
    server = _limited(http, max_header_bytes=4096)
    try:
        with server.connect() as s:
            s.sendall(get("/", "x-big: " + "a" * 10_000 + "\r\n"))
            answer = read_all(s)
        assert answer.startswith(b"HTTP/1.1 431 ") and answer.endswith(b'{"error":"header_too_large"}')
    finally:
        server.stop()


@pytest.mark.parametrize("http", ["corked", "httptools"])
def test_connections_over_the_cap_get_503_and_are_closed(http: str) -> None:
    """A clear answer beyond the cap (503 too_many_connections, then close)."""
    server = _limited(http, max_connections=2)
    try:
        a, b = server.connect(), server.connect()
        a.sendall(get("/a"))
        assert read_responses(a, 1)[0].endswith(b"/a:")
        with server.connect() as c:
            c.sendall(get("/c"))
            answer = read_all(c)
        assert answer.startswith(b"HTTP/1.1 503 ") and answer.endswith(b'{"error":"too_many_connections"}')
        b.close()
        deadline = time.monotonic() + BOUND
        while True:  # the server notices b's close on its next loop iteration
            with server.connect() as d:
                d.sendall(get("/d"))
                first = d.recv(12)
            if first == b"HTTP/1.1 200" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert first == b"HTTP/1.1 200"
        a.close()
    finally:
        server.stop()
