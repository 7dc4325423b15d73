"""A bare ASGI app served by uvicorn in a thread on a free loopback port, with the sidecar's HTTP protocols
(`mrtr_keys.service.server.HTTP_PROTOCOLS`): what the connection-level tests of tests/service drive."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from mrtr_keys.service.server import HTTP_PROTOCOLS

BOUND = 10.0
"""Seconds a client waits at most for an answer or a close (a bound on the test, not a timed assertion)."""


async def read_body(receive: Any) -> bytes | None:
    """The request's whole body, or None if the client went away first."""
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


class ThreadedServer:
    """`app` under uvicorn with protocol `http` (``corked`` or ``httptools``); `sndbuf` (bytes) is the
    listening socket's send buffer, inherited by accepted sockets; `config` goes to `uvicorn.Config`."""

    def __init__(self, app: Any, http: str, *, sndbuf: int | None = None, **config: Any) -> None:
        self.sock = socket.socket()
        if sndbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        cfg = uvicorn.Config(
            app, http=HTTP_PROTOCOLS[http], loop="uvloop", lifespan="off", log_level="critical", **config
        )
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + BOUND
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)

    def connect(self, source: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
        """A client socket connected from `source` (a loopback address), with receive buffer `rcvbuf`."""
        s = socket.socket()
        if rcvbuf is not None:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(BOUND)
        s.bind((source, 0))
        s.connect(("127.0.0.1", self.port))
        return s

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(BOUND)
        self.sock.close()
