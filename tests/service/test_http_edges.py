"""A real sidecar process under the HTTP abuse of issue 22 (item 6): its memory stays bounded and a normal
client keeps getting answers.

Before: 301 MB of chunked trailers took an authenticated sidecar from 116 to 430 MB RSS (unauthenticated
``POST /healthz``: 591 MB); 40 clients that never read a ~4 MB seal response kept their connections and
buffers for good (86 -> 263 MB); one address holding ~4,100 sockets made 42 of 69 probes of another client
get 503. Here, with small limits so it takes seconds (``write_timeout = 1``, ``--max-connections-per-peer
32``): 64 MB of trailers on each of two connections, 4 readers that never read a 4 MB response, and one
address opening 5,000 connections and holding them all (32 taken, the rest answered 503 at once), while a
client on another loopback address (127.0.0.2) seals and probes throughout (20 rounds a second). RSS is
sampled from /proc all along and must stay within 64 MB of the warmed-up baseline.
"""

from __future__ import annotations

import base64
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.fixtures.sidecar import Sidecar

WRITE_TIMEOUT = 1.0
PER_PEER = 32
RSS_MARGIN = 64 * 1024 * 1024
BOUND = 15.0
READERS = 4
GREEDY = 5000
"""Connections the greedy peer opens and keeps open (all at once: ``ulimit -n`` is 20,000 here)."""
BURST, BURST_SECONDS = 250, 0.25
"""The greedy peer opens `BURST` connections every `BURST_SECONDS` (1,000 a second: 5 s for all): as fast as
it goes, the refusals would only take CPU from the rest of the suite."""
HEADER_TIMEOUT = 60.0
"""Long, so the peer's accepted connections stay open (idle) while it opens the rest."""


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def rss(pid: int) -> int:
    """Resident set size of process `pid` in bytes (/proc/PID/status, VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Sampler:
    """The highest RSS of `pid` in each phase (`phase(name)` starts one), sampled every 20 ms until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid, self.name, self.peaks, self._stop = pid, "start", {"start": 0}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def phase(self, name: str) -> None:
        self.peaks[name] = rss(self.pid)
        self.name = name

    def _run(self) -> None:
        while not self._stop.is_set():
            name = self.name
            self.peaks[name] = max(self.peaks[name], rss(self.pid))
            time.sleep(0.02)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join(BOUND)
        return self.peaks


class NormalClient:
    """Seals and probes ``/healthz`` from 127.0.0.2 every 0.05 s; counts answers and failures."""

    def __init__(self, url: str, secret: str) -> None:
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        self.client = httpx.Client(base_url=url, transport=transport, timeout=5)
        self.secret, self.ok, self.failed = secret, 0, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        auth = {"authorization": f"Bearer {self.secret}"}
        while not self._stop.is_set():
            try:
                r = self.client.post("/v1/seal", json={"audience": "app", "payload": b64u(b"x")}, headers=auth)
                h = self.client.get("/healthz")
                if r.status_code == 200 and h.status_code == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"{r.status_code}/{h.status_code}")
            except httpx.HTTPError as exc:
                self.failed.append(type(exc).__name__)
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(BOUND)
        self.client.close()


def _connect(port: int, source: str = "127.0.0.1", rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(BOUND)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _trailer_flood(port: int, head: bytes) -> int:
    """Send `head` then up to 64 MiB of one trailer value; MiB sent before the sidecar cut it off."""
    s = _connect(port)
    sent = 0
    try:
        s.sendall(head + b"5\r\nhello\r\n0\r\nx-t: ")
        for _ in range(64):
            s.sendall(b"a" * (1 << 20))
            sent += 1
    except OSError:
        pass
    finally:
        s.close()
    return sent


def test_trailers_slow_readers_and_one_greedy_peer_leave_rss_bounded_and_others_served(
    keystore_path: Path, tmp_path: Path, sidecar_factory: Any
) -> None:
    cfg = tmp_path / "limits.toml"
    cfg.write_text(f"[sidecar]\nwrite_timeout = {WRITE_TIMEOUT}\nheader_timeout = {HEADER_TIMEOUT}\n")
    s: Sidecar = sidecar_factory(
        keystore_path, extra=["--config", str(cfg), "--max-connections-per-peer", str(PER_PEER)]
    )
    port = int(s.url.rsplit(":", 1)[1])
    secret = s.add_client("app", ["app"])
    big = b64u(b"p" * (2900 * 1024))  # a ~3.9 MB token comes back
    seal_big = f'{{"audience":"app","payload":"{big}"}}'.encode()
    with s.http(secret) as warm:  # warm up: allocations of a large seal are in the baseline
        for _ in range(3):
            assert warm.post("/v1/seal", content=seal_big, headers={"content-type": "application/json"}).is_success
    time.sleep(0.3)
    baseline = rss(s.proc.pid)
    sampler = Sampler(s.proc.pid)
    normal = NormalClient(s.url, secret)
    try:
        auth = f"authorization: Bearer {secret}\r\n".encode()
        chunked = b"transfer-encoding: chunked\r\n\r\n"
        sampler.phase("trailers")
        sent = [
            _trailer_flood(port, b"POST /v1/seal HTTP/1.1\r\nhost: t\r\n" + auth + chunked),
            _trailer_flood(port, b"POST /healthz HTTP/1.1\r\nhost: t\r\n" + chunked),
        ]
        assert all(mb < 16 for mb in sent), f"MiB of trailers taken: {sent}"

        request = (
            f"POST /v1/seal HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {secret}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(seal_big)}\r\n\r\n"
        ).encode() + seal_big
        sampler.phase("slow readers")
        readers = [_connect(port, "127.0.0.3", rcvbuf=4096) for _ in range(READERS)]
        for r in readers:
            r.sendall(request)  # and never read the answer
        time.sleep(WRITE_TIMEOUT + 1.5)  # the deadline, a sweep, the seals themselves
        for r in readers:
            r.settimeout(0.5)
            got = 0
            try:
                while chunk := r.recv(1 << 20):
                    got += len(chunk)
            except ConnectionResetError:
                pass
            except TimeoutError:
                raise AssertionError(f"a reader that never read is still connected after {got} bytes") from None
            assert got < 3_900_000, got
            r.close()

        time.sleep(0.3)
        sampler.phase("one greedy peer")  # starts from what the cut readers left: their buffers are freed
        before_greedy, greedy_started = normal.ok, time.monotonic()
        greedy = [_connect(port) for _ in range(PER_PEER)]  # taken, and held idle (header_timeout is long here)
        refused = 0
        while len(greedy) < GREEDY:  # paced: a burst every BURST_SECONDS; each refused one reads its 503
            burst = [_connect(port) for _ in range(min(BURST, GREEDY - len(greedy)))]
            for c in burst:
                refused += c.recv(4096).endswith(b'{"error":"too_many_connections_from_peer"}')
            greedy += burst
            time.sleep(BURST_SECONDS)
        assert refused == GREEDY - PER_PEER
        time.sleep(0.5)  # the normal client keeps going while the peer holds its share
        during_greedy, greedy_took = normal.ok - before_greedy, time.monotonic() - greedy_started
        for c in greedy:
            c.close()
    finally:
        normal.stop()
        peaks = sampler.stop()
    assert normal.failed == [] and normal.ok > 10, (normal.ok, normal.failed[:5])
    assert during_greedy > 10  # answered all along, not only before and after
    mib = {name: (peak - baseline) >> 20 for name, peak in peaks.items()}
    print(
        f"RSS baseline {baseline >> 20} MiB; peak above it by phase (MiB): {mib}; normal client: {normal.ok} rounds, "
        f"{during_greedy} of them in the {greedy_took:.1f} s the peer opened and held {GREEDY} connections"
    )
    for name in ("trailers", "slow readers", "one greedy peer"):
        assert peaks[name] - baseline < RSS_MARGIN, mib
    assert s.proc.poll() is None
