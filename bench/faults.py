"""Part: a dependency gone silent (issue 22): the sidecar's latency with a blackholed store, and how fast
strict readiness turns 503 on a silent audit store.

The store sits behind the fault proxy (`tests.support.faults`), which blackholes it: connections held
open, nothing answered.

* For each replay store (Redis, PostgreSQL): ``/healthz`` and seal p99 from one closed-loop client for
  `Settings.wrk_seconds` while 16 clients keep making single-use unseals against the blackholed store
  (each refused 503 after the store's 1 s deadline), against the same p99 with the store healthy and
  no unseal load (the anchor, same run). Target: <= 1.5x.
* The same two p99s with the sidecar's other dependencies blackholed, against the same sidecar healthy:
  its PostgreSQL audit store (not strict: the seals' events wait in the queue) and its keystore, a Vault /
  OpenBao KV secret (``vault-kv://``; the ring watcher's reads wait, the loaded ring keeps serving).
  Target: <= 1.5x.
* A strict sidecar (``strict_audit = true``) whose PostgreSQL audit store is blackholed under ~50 seals
  a second: seconds until ``/readyz`` answers 503. Target: <= 2 s.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
from tests.support.net import stop_process
from tests.support.proxy import CountingProxy
from tests.support.services import start_sidecar_process

from bench.common import Settings
from bench.report import Row
from bench.services import Services
from bench.single_use import _postgres, _redis
from mrtr_keys.changes.create import create_ring
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.service.clients import add_client

PART = "faults"
AUDIENCE = "svc"
UNSEALERS = 16


def _through(url: str, proxy: CountingProxy) -> str:
    parsed = urlparse(url)
    user = f"{parsed.username}@" if parsed.username else ""
    return parsed._replace(netloc=f"{user}127.0.0.1:{proxy.port}").geturl()


def _p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98] * 1000 if len(samples) >= 2 else float("nan")


def _probe(url: str, secret: str, seconds: float) -> tuple[list[float], list[float]]:
    """(/healthz latencies, seal latencies) in seconds, alternating, for `seconds`."""
    health: list[float] = []
    seals: list[float] = []
    with httpx.Client(base_url=url, timeout=30, headers={"authorization": f"Bearer {secret}"}) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            c.get("/healthz")
            health.append(time.perf_counter() - t)
            t = time.perf_counter()
            c.post("/v1/seal", json={"audience": AUDIENCE, "payload": "AAAA"})
            seals.append(time.perf_counter() - t)
    return health, seals


def _sidecar(
    services: Services,
    work: Path,
    args: list[str],
    config: str = "",
    keystore: str | None = None,
    env: dict[str, str] | None = None,
) -> tuple[object, str]:
    """A sidecar on a new file ring in `work` (or on `keystore`, a ring already there), one client."""
    work.mkdir(parents=True, exist_ok=True)
    ring: Path | str = keystore or work / "keyring.json"
    if keystore is None:
        create_ring(FileKeystore(ring), audiences=[AUDIENCE])
    _, secret = add_client(work / "clients.json", "bench", audiences=[AUDIENCE])
    if config:
        (work / "sidecar.toml").write_text(config)
        args = [*args, "--config", str(work / "sidecar.toml")]
    svc = start_sidecar_process(ring, workdir=work, args=["--clients", str(work / "clients.json"), *args], env=env)
    services.track(svc.proc)
    return svc, secret


def _rows(
    what: str, health: tuple[list[float], list[float]], seal: tuple[list[float], list[float]], note: str
) -> list[Row]:
    """The /healthz and seal p99 rows: (healthy, blackholed) samples each; target <= 1.5x."""
    rows = []
    for name, (before, during) in (("/healthz", health), ("seal", seal)):
        p0, p1 = _p99(before), _p99(during)
        row = Row(PART, f"{name} p99, {what} blackholed", "ms", p1, None, f"p99 healthy {p0:.1f} ms")
        row.ratio = p1 / p0 if p0 else None
        row.note = note
        rows.append(row.decide(row.ratio, "<= 1.5x"))
    return rows


def _blackholed(base: str, secret: str, seconds: float, proxy: CountingProxy) -> tuple[list[float], ...]:
    """(/healthz, seal) latencies healthy, then (/healthz, seal) with `proxy` blackholed (restored after)."""
    _probe(base, secret, 0.5)  # warm
    health0, seal0 = _probe(base, secret, seconds)
    proxy.faults.blackhole()
    try:
        time.sleep(0.5)
        health1, seal1 = _probe(base, secret, seconds)
    finally:
        proxy.faults.restore()
    return health0, health1, seal0, seal1


def _audit_rows(services: Services, settings: Settings, pg_url: str) -> list[Row]:
    """The sidecar's PostgreSQL audit store blackholed (not strict): seals queue their events."""
    proxy = CountingProxy(urlparse(pg_url).port or 5432, http=False)
    try:
        config = f'[sidecar]\naudit = "{_through(pg_url, proxy)}"\n'
        svc, secret = _sidecar(services, services.workdir / "faults-audit-lax", [], config)
        base: str = svc.url  # type: ignore[attr-defined]
        health0, health1, seal0, seal1 = _blackholed(base, secret, settings.wrk_seconds, proxy)
        stop_process(svc.proc)  # type: ignore[attr-defined]
    finally:
        proxy.close()
    return _rows("PostgreSQL audit store", (health0, health1), (seal0, seal1), f"{len(seal1)} seals audited meanwhile")


def _keystore_rows(services: Services, settings: Settings) -> list[Row]:
    """The sidecar's keystore, an OpenBao KV secret, blackholed: the watcher (every 0.2 s) waits, the
    loaded ring serves."""
    bao = services.bao
    url = "vault-kv://secret/bench-faults/keyring"
    work = services.workdir / "faults-keystore"
    work.mkdir(parents=True, exist_ok=True)
    init = [sys.executable, "-c", "from mrtr_keys.cli.main import run; run()", "init", "--keystore", url]
    init += ["--audience", AUDIENCE]
    subprocess.run(init, env={**os.environ, **bao.env()}, check=True, capture_output=True, cwd=work)
    proxy = CountingProxy(bao.port, http=False)
    try:
        env = {**bao.env(), "VAULT_ADDR": proxy.url, "BAO_ADDR": proxy.url}
        svc, secret = _sidecar(services, work, ["--reload-interval", "0.2"], keystore=url, env=env)
        base: str = svc.url  # type: ignore[attr-defined]
        health0, health1, seal0, seal1 = _blackholed(base, secret, settings.wrk_seconds, proxy)
        stop_process(svc.proc)  # type: ignore[attr-defined]
    finally:
        proxy.close()
    return _rows("Vault KV keystore", (health0, health1), (seal0, seal1), "ring watcher every 0.2 s")


def _replay_rows(services: Services, settings: Settings, name: str, url: str, port: int) -> list[Row]:
    proxy = CountingProxy(port, http=False)
    try:
        svc, secret = _sidecar(services, services.workdir / f"faults-{name}", ["--replay-store", _through(url, proxy)])
        base: str = svc.url  # type: ignore[attr-defined]
        seconds = settings.wrk_seconds
        _probe(base, secret, 0.5)  # warm
        health0, seal0 = _probe(base, secret, seconds)
        with httpx.Client(base_url=base, headers={"authorization": f"Bearer {secret}"}) as c:
            tokens = [
                c.post("/v1/seal", json={"audience": AUDIENCE, "payload": "AA"}).json()["token"] for _ in range(400)
            ]
        stop = threading.Event()
        refused: list[float] = []

        def unseal() -> None:
            with httpx.Client(base_url=base, timeout=30, headers={"authorization": f"Bearer {secret}"}) as c:
                while not stop.is_set() and tokens:
                    t = time.perf_counter()
                    c.post("/v1/unseal", json={"audience": AUDIENCE, "token": tokens.pop()})
                    refused.append(time.perf_counter() - t)

        proxy.faults.blackhole()
        workers = [threading.Thread(target=unseal, daemon=True) for _ in range(UNSEALERS)]
        for w in workers:
            w.start()
        time.sleep(0.5)
        health1, seal1 = _probe(base, secret, seconds)
        stop.set()
        for w in workers:
            w.join(10)
        proxy.faults.restore()
        stop_process(svc.proc)  # type: ignore[attr-defined]
    finally:
        proxy.close()
    note = f"{len(refused)} unseals, slowest {max(refused, default=0):.2f} s (deadline 1 s)"
    return _rows(f"{name} replay store", (health0, health1), (seal0, seal1), note)


def _readiness_row(services: Services, pg_url: str) -> Row:
    proxy = CountingProxy(urlparse(pg_url).port or 5432, http=False)
    try:
        config = f'[sidecar]\naudit = "{_through(pg_url, proxy)}"\nstrict_audit = true\n'
        svc, secret = _sidecar(services, services.workdir / "faults-audit", [], config)
        base: str = svc.url  # type: ignore[attr-defined]
        stop = threading.Event()

        def traffic() -> None:
            with httpx.Client(base_url=base, timeout=30, headers={"authorization": f"Bearer {secret}"}) as c:
                while not stop.is_set():
                    c.post("/v1/seal", json={"audience": AUDIENCE, "payload": "AA"})
                    time.sleep(0.02)

        loader = threading.Thread(target=traffic, daemon=True)
        loader.start()
        time.sleep(1.0)
        with httpx.Client(base_url=base, timeout=30) as c:
            ready_before = c.get("/readyz").status_code
            proxy.faults.blackhole()
            started = time.monotonic()
            while c.get("/readyz").status_code != 503 and time.monotonic() - started < 30:
                time.sleep(0.05)
            seconds = time.monotonic() - started
        stop.set()
        proxy.faults.restore()
        loader.join(10)
        stop_process(svc.proc)  # type: ignore[attr-defined]
    finally:
        proxy.close()
    row = Row(PART, "strict /readyz 503 after a PostgreSQL audit store goes silent", "s", seconds)
    row.note = f"/readyz before: {ready_before}"
    return row.decide(seconds, "<= 2 s")


def run(services: Services, settings: Settings) -> list[Row]:
    rows: list[Row] = []
    with _redis() as url:
        rows += _replay_rows(services, settings, "Redis", url, urlparse(url).port or 6379)
    with _postgres() as url:
        rows += _replay_rows(services, settings, "PostgreSQL", url, urlparse(url).port or 5432)
        rows += _audit_rows(services, settings, url)
        rows.append(_readiness_row(services, url))
    rows += _keystore_rows(services, settings)
    return rows
