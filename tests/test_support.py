"""The shared test and bench helpers (tests/support): ports without luck, the one counting proxy.

Our decisions: no fixture may depend on a port staying free; an
outage is simulated by stopping the proxy, which keeps its port reserved.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.support.net import launch_on_free_port, refused_port, stop_process
from tests.support.proxy import CountingProxy, header


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        out = b"echo:" + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _post(port: int, body: bytes, op: str = "A", conn: http.client.HTTPConnection | None = None) -> bytes:
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("POST", "/", body=body, headers={"X-Op": op})
    return c.getresponse().read()


def test_the_proxy_counts_requests_by_key_on_kept_alive_connections(upstream: int) -> None:
    with CountingProxy(upstream, classify=lambda head: (header(head, b"x-op") or b"?").decode()) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        assert _post(proxy.port, b"x" * 70_000, "A", conn) == b"echo:" + b"x" * 70_000
        assert _post(proxy.port, b"y", "B", conn) == b"echo:y"
        assert _post(proxy.port, b"z", "B") == b"echo:z"
        assert proxy.calls == {"A": 1, "B": 2} and proxy.count == 3
        proxy.reset()
        assert proxy.count == 0


def test_a_response_hook_rewrites_the_body_and_its_length(upstream: int) -> None:
    with CountingProxy(upstream) as proxy:
        proxy.response_hook = lambda key, body: body.replace(b"echo:", b"rewritten by the proxy:")
        assert _post(proxy.port, b"hello") == b"rewritten by the proxy:hello"


def test_stop_refuses_and_cuts_then_start_serves_again_on_the_same_port(upstream: int) -> None:
    with CountingProxy(upstream) as proxy:
        port = proxy.port
        open_conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        assert _post(port, b"1", conn=open_conn) == b"echo:1"
        proxy.stop()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            _post(port, b"2", conn=open_conn)
        with socket.socket() as intruder:  # the port stays ours while stopped
            with pytest.raises(OSError):
                intruder.bind(("127.0.0.1", port))
        proxy.start()
        assert proxy.port == port
        assert _post(port, b"3") == b"echo:3"


def test_refused_port_refuses_while_held() -> None:
    with refused_port() as port:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)


SERVER = (
    "import socket, sys, time\n"
    "s = socket.socket()\n"
    "try:\n"
    "    s.bind(('127.0.0.1', int(sys.argv[1])))\n"
    "except OSError as e:\n"
    "    print(e.strerror); sys.exit(1)\n"
    "s.listen(); time.sleep(60)\n"
)


def test_a_server_whose_port_was_taken_is_started_again_on_another(tmp_path: Path) -> None:
    """The race `free_port` leaves open: someone binds the port first; the launcher moves on."""
    taken: list[socket.socket] = []

    def start(port: int) -> tuple[subprocess.Popen[Any], Path]:
        if not taken:  # the first port is grabbed by someone else before the server binds it
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            taken.append(s)
        log = tmp_path / f"server-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=out, stderr=subprocess.STDOUT)
        return proc, log

    server = launch_on_free_port(start, ready=lambda port: port != taken[0].getsockname()[1] and _listening(port))
    try:
        assert server.port != taken[0].getsockname()[1]
        assert server.proc.poll() is None
    finally:
        stop_process(server.proc)
        taken[0].close()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_proxy_blackholes_delays_throttles_resets_after_a_marker_and_flaps(upstream: int) -> None:
    with CountingProxy(upstream) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=0.5)
        assert _post(proxy.port, b"a", conn=conn) == b"echo:a"
        proxy.faults.blackhole()  # held open, nothing answered: the client times out, it is not refused
        with pytest.raises(TimeoutError):
            _post(proxy.port, b"b", conn=conn)
        proxy.faults.restore()
        proxy.faults.latency(0.3)
        started = time.monotonic()
        assert _post(proxy.port, b"c") == b"echo:c"
        assert time.monotonic() - started >= 0.6  # each way
        proxy.faults.latency(0)
        proxy.faults.throttle(200_000)  # a slow link: a short exchange passes, a large upload takes its time
        started = time.monotonic()
        assert _post(proxy.port, b"e") == b"echo:e"
        short = time.monotonic() - started
        started = time.monotonic()
        assert _post(proxy.port, b"f" * 100_000) == b"echo:" + b"f" * 100_000
        assert time.monotonic() - started >= 0.9 > short  # 100 kB up and back at 200 kB/s
        proxy.faults.restore()
        proxy.faults.reset_after(0, after=b"marker")
        assert _post(proxy.port, b"plain") == b"echo:plain"  # not armed by this one
        with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
            _post(proxy.port, b"marker")  # the request went up, its answer never comes back
        assert proxy.faults.resets == 1
        proxy.faults.flap(2, down=0.1, up=0.1).join(5)
        assert proxy.faults.flaps == 2
        assert _post(proxy.port, b"d") == b"echo:d"
