"""Part: legitimate latency while 1,000 stalled connections are held.

A slowloris-style client keeps `STALLED` connections open against the sidecar, a quarter each sending
nothing, a partial head, a short body and an unfinished chunked body; the sidecar closes each within its
timeouts (5 s by default) and the holder opens a new one at once, so about `STALLED` are held throughout.
Meanwhile wrk drives ``POST /v1/seal`` at c=16 (the "sidecar seal c=16" scenario of `bench.sidecar_load`).
Anchor: the same wrk run against the same sidecar without the stalled connections, interleaved (without,
with, without, ...). Row: p99 with / p99 without, target <= 1.5x.

Everything on loopback (the stalled connections from `PEERS` loopback addresses); the holder runs in a thread
of the bench process and is stopped (every socket closed) after each run.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time

from bench.common import Settings, envelope_payload
from bench.report import Row, spread_of
from bench.services import AUDIENCE, Services, module_available
from bench.sidecar_load import Scenario, b64u, ensure_wrk, lua_script, run_wrk, start_sidecar
from bench.timing import median, paired_ratio

PART = "stalled"
STALLED = 1000
CONNECTIONS = 16
PEERS = 8
"""Source addresses the stalled connections come from (127.0.0.10 ...), 125 each: a crowd of slow clients,
not one peer (which the sidecar's per-peer limit, 256 by default, would refuse beyond its share)."""
KINDS = (
    b"",
    b"POST /v1/seal HTTP/1.1\r\nhost: bench\r\nx-slow: ",
    b"POST /v1/seal HTTP/1.1\r\nhost: bench\r\n{auth}content-length: 100\r\n\r\n0123456789",
    b"POST /v1/seal HTTP/1.1\r\nhost: bench\r\n{auth}transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
)


class Holder:
    """Holds `count` stalled connections to 127.0.0.1:`port`, reopening each one the server closes."""

    def __init__(self, port: int, secret: str, count: int = STALLED) -> None:
        self.port = port
        auth = f"authorization: Bearer {secret}\r\n".encode()
        self.kinds = [k.replace(b"{auth}", auth) for k in KINDS]
        self.count = count
        self.reopened = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Holder:
        self._thread.start()
        if not self._ready.wait(60):
            raise TimeoutError("could not open the stalled connections")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _open(self, sel: selectors.BaseSelector, i: int) -> None:
        source = (f"127.0.0.{10 + i % PEERS}", 0)  # many clients, each under --max-connections-per-peer
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10, source_address=source)
        data = self.kinds[i % len(self.kinds)]
        if data:
            s.sendall(data)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            for i in range(self.count):
                self._open(sel, i)
            self._ready.set()
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=0.1):
                    s = key.fileobj
                    assert isinstance(s, socket.socket)
                    try:
                        data = s.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:  # closed by the server (its timeout): stall again
                        sel.unregister(s)
                        s.close()
                        self._open(sel, key.data)
                        self.reopened += 1
        finally:
            for key in list(sel.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
            sel.close()


def run(services: Services, settings: Settings) -> list[Row]:
    name = f"sidecar seal c={CONNECTIONS} p99 with {STALLED} stalled connections"
    if not module_available("mrtr_keys.service.protocol"):
        return [Row.missing(PART, name, "n/a (not built): mrtr_keys.service.protocol", target="<= 1.5x")]
    wrk = ensure_wrk()
    if wrk is None:
        return [Row.missing(PART, name, "n/a: wrk not installed (apt-get install -y wrk)", target="<= 1.5x")]
    sidecar = start_sidecar(services, name="sidecar-stalled")
    auth = {"Authorization": f"Bearer {sidecar.secret}"}
    script = lua_script(
        services.workdir, "seal-stalled", {"audience": AUDIENCE, "payload": b64u(envelope_payload())}, auth
    )
    seal = Scenario(name, sidecar.url + "/v1/seal", script, CONNECTIONS)
    port = int(sidecar.url.rsplit(":", 1)[1])
    without: list[float] = []
    with_: list[float] = []
    rates: list[float] = []
    errors = 0
    reopened = 0
    for r in range(settings.wrk_repeats):
        for stalled in (False, True) if r % 2 == 0 else (True, False):
            if stalled:
                with Holder(port, sidecar.secret) as holder:
                    result = run_wrk(wrk, seal.url, seal.script, connections=CONNECTIONS, seconds=settings.wrk_seconds)
                    reopened += holder.reopened
                with_.append(result.p99_ms)
                rates.append(result.rps)
                time.sleep(0.5)  # let the server see the holder's closes
            else:
                result = run_wrk(wrk, seal.url, seal.script, connections=CONNECTIONS, seconds=settings.wrk_seconds)
                without.append(result.p99_ms)
            errors += result.errors
    anchor = Row(
        PART, f"sidecar seal c={CONNECTIONS} p99 without stalled connections", "ms", median(without), spread_of(without)
    )
    row = Row(PART, name, "ms", median(with_), spread_of(with_), anchor.name, paired_ratio(with_, without))
    row.note = f"{median(rates):.0f} req/s with them; {reopened} stalled connections closed by the sidecar and reopened"
    if errors:
        row.note += f"; {errors} non-2xx or socket errors"
    row.decide(row.ratio, "<= 1.5x")
    if errors:
        row.status = "MISS"
    return [anchor, row]
