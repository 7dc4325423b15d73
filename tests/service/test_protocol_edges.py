"""HTTP limits uvicorn leaves open, held by the sidecar's protocol (issue 22, item 6), against a real uvicorn.

* Trailers of a chunked body count against ``max_header_bytes``: before, httptools buffered a trailer
  value whole and uvicorn appended every trailer to the request's headers (301 MB of trailers: +314 MB
  RSS). Now the connection is closed once they pass the limit, and small trailers never reach the app.
* A response the client does not read is cut after ``write_timeout`` without progress (before: kept
  with its buffer for good).
* ``max_connections_per_peer``: one address cannot take every connection; another address still gets in.

Each test runs both protocol choices, with small limits so it takes a second or two. The server's
listening socket has a small send buffer, so a response the client does not read stays in the server's
buffer (as it does once a real network's buffers are full) instead of the kernel's.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from mrtr_keys.service.protocol import ConnectionLimits
from tests.support.asgi import BOUND, ThreadedServer, read_body

pytestmark = pytest.mark.e2e  # a real server and multi-second deadlines: out of the fast loop

BIG = 4 * 1024 * 1024


class App:
    """``/big`` answers 4 MiB; anything else echoes its path, body and how many headers it got."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.connection_limits = limits

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        if body is None:
            return
        if scope["path"] == "/big":
            out = b"b" * BIG
        else:
            names = b",".join(name for name, _ in scope["headers"])
            out = scope["path"].encode() + b":" + body + b":" + names
        headers = [(b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})


class Server(ThreadedServer):
    def __init__(self, http: str, limits: ConnectionLimits) -> None:
        super().__init__(App(limits), http, sndbuf=32 * 1024)


@pytest.fixture(params=["corked", "httptools"])
def http(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _server(http: str, **limits: Any) -> Iterator[Server]:
    server = Server(http, ConnectionLimits(**limits))
    try:
        yield server
    finally:
        server.stop()


def answer(s: socket.socket, path: str = "/ok") -> bytes:
    """One GET on `s`; the body of its answer."""
    s.sendall(f"GET {path} HTTP/1.1\r\nhost: t\r\n\r\n".encode())
    return read_answer(s)


def read_answer(s: socket.socket) -> bytes:
    """The body of the next answer on `s` (its head and body may come in separate reads)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, "closed"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed"
        body += chunk
    return body


def read_until_closed(s: socket.socket) -> tuple[int, bool]:
    """Bytes read until the server closed `s`, and whether it closed (False: the bound ran out)."""
    n = 0
    try:
        while chunk := s.recv(65536):
            n += len(chunk)
    except TimeoutError:
        return n, False
    except ConnectionResetError:
        pass
    return n, True


def test_trailers_count_against_the_header_limit_and_never_reach_the_app(http: str) -> None:
    for server in _server(http, max_header_bytes=4096):
        with server.connect() as s:  # a small trailer: served, and not among the request's headers
            s.sendall(
                b"POST /t HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\n0\r\nx-trailer: 1\r\n\r\n"
            )
            body = read_answer(s)
        assert body == b"/t:hello:host,transfer-encoding"
        flood = server.connect()
        flood.sendall(b"POST /t HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-t: ")
        sent, cut = 0, False
        try:
            for _ in range(64):  # up to 64 MiB of one trailer value, stopped by the server
                flood.sendall(b"a" * (1 << 20))
                sent += 1 << 20
        except OSError:
            cut = True
        assert cut and sent < 16 * (1 << 20), f"the server took {sent} bytes of trailers"
        flood.close()
        with server.connect() as other:  # everyone else is served meanwhile
            assert answer(other).startswith(b"/ok:")


def test_a_response_the_client_does_not_read_is_cut_after_the_write_timeout(http: str) -> None:
    for server in _server(http, write_timeout=0.5):
        stalled = server.connect(rcvbuf=4096)
        stalled.sendall(b"GET /big HTTP/1.1\r\nhost: t\r\n\r\n")
        time.sleep(0.5 + 0.5 + 1.0)  # write_timeout, one sweep, slack: never reading meanwhile
        got, closed = read_until_closed(stalled)
        assert closed and got < BIG, f"read {got} bytes, closed: {closed}"
        stalled.close()
        with server.connect() as reader:  # a client that reads gets its 4 MiB whatever the deadline
            assert len(answer(reader, "/big")) == BIG


def test_a_slow_but_steady_reader_is_not_cut(http: str) -> None:
    """Progress moves the write deadline: 32 KiB read every 0.2 s for 1.5 s (three deadlines) keeps it open."""
    for server in _server(http, write_timeout=0.5):
        with server.connect(rcvbuf=4096) as slow:
            slow.sendall(b"GET /big HTTP/1.1\r\nhost: t\r\n\r\n")
            got = 0
            until = time.monotonic() + 1.5
            while time.monotonic() < until:
                step = got + 32 * 1024
                while got < step:
                    got += len(slow.recv(step - got))
                time.sleep(0.2)
            rest, closed = 0, False
            while got + rest < BIG + 38:  # the head (status line and content-length) and the body
                chunk = slow.recv(1 << 20)
                if not chunk:
                    closed = True
                    break
                rest += len(chunk)
            assert not closed and got + rest >= BIG, (got, rest)


def test_one_address_cannot_take_every_connection(http: str) -> None:
    for server in _server(http, max_connections_per_peer=3):
        held = [server.connect() for _ in range(3)]
        assert answer(held[0]).startswith(b"/ok:")
        with server.connect() as fourth:
            fourth.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")
            refused = fourth.recv(65536)
        assert refused.startswith(b"HTTP/1.1 503 ")
        assert refused.endswith(b'{"error":"too_many_connections_from_peer"}')
        with server.connect(source="127.0.0.2") as other:  # another address still gets in
            assert answer(other).startswith(b"/ok:")
        held.pop().close()
        deadline = time.monotonic() + BOUND
        while True:  # the server counts the close on its next loop iteration
            with server.connect() as again:
                again.sendall(b"GET /again HTTP/1.1\r\nhost: t\r\n\r\n")
                first = again.recv(12)
            if first == b"HTTP/1.1 200" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert first == b"HTTP/1.1 200"
        for s in held:
            s.close()


def test_a_capped_peers_surplus_does_not_count_against_the_global_cap(http: str) -> None:
    """Issue 39: the refused surplus of one address (lingering for `LINGER_SECONDS`) took the global cap's
    places, so another address got ``too_many_connections``. Now only admitted connections count."""
    for server in _server(http, max_connections=6, max_connections_per_peer=3):
        held = [server.connect() for _ in range(3)]
        assert answer(held[0]).startswith(b"/ok:")
        surplus = [server.connect() for _ in range(10)]  # each answered at once, and lingering
        for s in surplus:
            assert s.recv(65536).endswith(b'{"error":"too_many_connections_from_peer"}')
        others = [server.connect(source="127.0.0.2") for _ in range(3)]  # 13 open, 3 admitted: room for 3
        for s in others:
            assert answer(s).startswith(b"/ok:")
        with server.connect(source="127.0.0.3") as seventh:  # the global cap counts the admitted 6
            seventh.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")
            assert seventh.recv(65536).endswith(b'{"error":"too_many_connections"}')
        for s in held + surplus + others:
            s.close()


def test_limits_come_from_the_config(tmp_path: Any) -> None:
    from mrtr_keys.service.config import ServiceConfig

    limits = ConnectionLimits.from_config(ServiceConfig(max_connections_per_peer=7, write_timeout=2.5))
    assert (limits.max_connections_per_peer, limits.write_timeout) == (7, 2.5)
    assert asyncio.iscoroutinefunction(App(limits).__call__)
