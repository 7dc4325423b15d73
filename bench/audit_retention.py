"""Rows of part audit_scale (issue 26): a running sidecar's own retention prunes while traffic continues.

A SQLite audit store is filled with genuine events over 40 days (`bench.audit_log.fill`;
``MRTR_KEYS_BENCH_RETENTION_EVENTS``, default 200,000; ``--quick``: 10,000). Each round (3; quick:
1) starts ``mrtr-keys serve`` (1 worker, the default) over a fresh copy of that store with
``--audit-retention 30d --audit-retention-interval I`` (8 s; quick: 3 s): its first run, `I`
seconds after start, prunes the oldest ten days (a quarter of the events). One client sends
sequential seal+unseal pairs over one keep-alive connection (``http.client``), each pair timed
(wall clock, the client's view), and reads ``/readyz`` every 0.2 s on a second connection, from
start until the run has succeeded and `AFTER` seconds more.

* **Anchor**: the p99 of the pairs outside the run (before it and after it, same process, same
  store, minutes apart at most: the noise of a shared machine hits both alike).
* **During the prune**: the p99 of the pairs that overlap the run (``audit_retention.last_attempt``
  .. ``last_success``); ratio (median over rounds of the per-round ratio) target <= 2x (issue 26:
  "no request slower than 2x its normal p99 during the prune").
* **Events deleted** by the run (``mrtr_sidecar_audit_retention_deleted_total`` in ``/metrics``):
  proof that a real prune overlapped the measured window (a run that began before measuring is a
  MISS).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import shutil
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.support.net import stop_process
from tests.support.services import add_client_cli, start_sidecar_process

from bench.audit_log import fill
from bench.common import Settings, envelope_payload
from bench.report import Row, spread_of
from bench.services import AUDIENCE, Services

PART = "audit_scale"
POLL = 0.2
"""Seconds between reads of ``/readyz``."""
WARM = 50
"""Pairs before measuring (connection and codec warm)."""
AFTER = 2.0
"""Seconds measured after the run (with the time before it: the anchor)."""


class Client:
    """Sequential seal+unseal pairs on one keep-alive connection; ``/readyz`` on another."""

    def __init__(self, url: str, secret: str) -> None:
        port = int(url.rsplit(":", 1)[1])
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.probe = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}
        payload = base64.urlsafe_b64encode(envelope_payload()).rstrip(b"=").decode()
        self.seal_body = json.dumps({"audience": AUDIENCE, "payload": payload})

    def _post(self, path: str, body: str) -> dict[str, Any]:
        self.conn.request("POST", path, body, self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: HTTP {resp.status} {data[:200]!r}")
        return json.loads(data)  # type: ignore[no-any-return]

    def pair(self) -> tuple[float, float]:
        """(start, end) wall times (``time.time``, to compare with the sidecar's) of one seal+unseal."""
        started = time.time()
        token = self._post("/v1/seal", self.seal_body)["token"]
        self._post("/v1/unseal", json.dumps({"audience": AUDIENCE, "token": token}))
        return started, time.time()

    def get(self, path: str) -> str:
        self.probe.request("GET", path)
        return self.probe.getresponse().read().decode()

    def close(self) -> None:
        self.conn.close()
        self.probe.close()


def _drive(client: Client, *, until: Any, cap: float, pace: float = 0.0) -> list[tuple[float, float]]:
    """Pairs until `until(readyz doc)` is true (checked every `POLL` s) or `cap` seconds pass; `pace` s
    between pairs (0: back to back)."""
    pairs: list[tuple[float, float]] = []
    end = time.monotonic() + cap
    next_poll = 0.0
    while time.monotonic() < end:
        pairs.append(client.pair())
        if pace:
            time.sleep(pace)
        if time.monotonic() >= next_poll:
            next_poll = time.monotonic() + POLL
            if until(json.loads(client.get("/readyz"))):
                break
    return pairs


def _p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _ring(home: Path) -> str:
    """A local ring in `home` and a client of it; returns the client's secret."""
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.keystores.file import FileKeystore

    create_ring(FileKeystore(home / "keyring.json"))
    return add_client_cli(home / "keyring.json", "bench", AUDIENCE)


def _sidecar(services: Services, home: Path, url: str, cps: Path, extra: list[str]) -> Any:
    """``mrtr-keys serve`` (1 worker) on the ring in `home` over the audit store `url`; stopped by the caller."""
    ring = home / "keyring.json"
    env = {"MRTR_KEYS_AUDIT": url, "MRTR_KEYS_AUDIT_CHECKPOINTS": str(cps)}
    service = start_sidecar_process(
        ring, workdir=home, args=["--reload-interval", "60", *extra], env=env, ready_path="/readyz"
    )
    services.track(service.proc)
    return service


def _round(
    services: Services, home: Path, url: str, secret: str, cps: Path, interval: float, pace: float = 0.0
) -> dict[str, Any]:
    """One sidecar with retention on: pairs before its first run, during it, and `AFTER` s after it."""
    extra = ["--audit-retention", "30d", "--audit-retention-interval", f"{interval:g}"]
    service = _sidecar(services, home, url, cps, extra)
    client = Client(service.url, secret)
    status: dict[str, Any] = {}

    def pruned(doc: dict[str, Any]) -> bool:
        status.update(doc.get("audit_retention") or {})
        return bool(status.get("last_success") or status.get("error"))

    try:
        for _ in range(WARM):  # the connection and the codec warmed up
            client.pair()
        measured_from = time.time()
        pairs = _drive(client, until=pruned, cap=interval + 300, pace=pace)
        pairs += _drive(client, until=lambda _: False, cap=AFTER, pace=pace)
        metrics = client.get("/metrics")
    finally:
        client.close()
        stop_process(service.proc)
    if status.get("error") or not status.get("last_success"):
        raise RuntimeError(f"the retention run did not succeed: {status.get('error') or 'no run in the window'}")
    began, ended = _ts(status["last_attempt"]), _ts(status["last_success"])
    m = re.search(r"^mrtr_sidecar_audit_retention_deleted_total (\S+)$", metrics, re.M)
    return {
        "quiet": [(b - a) * 1000 for a, b in pairs if b < began or a > ended],
        "during": [(b - a) * 1000 for a, b in pairs if b >= began and a <= ended],
        "seconds": ended - began,
        "lead": began - measured_from,
        "deleted": float(m.group(1)) if m else 0.0,
    }


def run(services: Services, settings: Settings) -> list[Row]:
    env_n = os.environ.get("MRTR_KEYS_BENCH_RETENTION_EVENTS")
    n = 10_000 if settings.quick else int(env_n or 200_000)
    interval = 3.0 if settings.quick else 8.0
    rounds = 1 if settings.quick else 3
    home = services.workdir / "audit-retention"
    home.mkdir()
    pristine, db, cps = home / "filled.db", home / "audit.db", home / "checkpoints.jsonl"
    secret = _ring(home)
    from mrtr_keys.audit.writing.fingerprint import load_audit_key

    fill(f"sqlite://{pristine}", n, audit_key=load_audit_key(home))  # the sidecar's own key (beside its ring)
    label = f"{n:,} events over 40 days"
    results = []
    for _ in range(rounds):  # each round on a fresh copy of the filled store
        for p in [cps, *home.glob("audit.db*")]:
            p.unlink(missing_ok=True)
        shutil.copyfile(pristine, db)
        # --quick (a smoke run): about 200 pairs a second, enough for the rows, not a busy core
        pace = 0.005 if settings.quick else 0.0
        results.append(_round(services, home, f"sqlite://{db}", secret, cps, interval, pace))
    shutil.rmtree(home, ignore_errors=True)
    quiet = [_p99(r["quiet"]) for r in results]
    during = [_p99(r["during"]) for r in results]
    ratios = [d / q for d, q in zip(during, quiet, strict=True)]
    deleted = min(r["deleted"] for r in results)
    every = [x for r in results for x in r["during"]]
    rows = [
        Row(PART, f"seal+unseal p99 outside the prune (anchor), {label}", "ms", statistics.median(quiet),
            spread_of(quiet), samples=quiet,
            note=f"{sum(len(r['quiet']) for r in results):,} sequential keep-alive pairs before and {AFTER:g} s "
            f"after the run, {rounds} round(s); max {max(max(r['quiet']) for r in results):.1f} ms"),
        Row(PART, f"seal+unseal p99 during a retention prune, {label}", "ms", statistics.median(during),
            spread_of(during), "p99 outside the prune", statistics.median(ratios), samples=during,
            note=f"{len(every):,} pairs overlapping runs of "
            f"{', '.join(f'{secs:.2f}' for secs in (r['seconds'] for r in results))} s; max {max(every):.1f} ms; "
            f"ratios {', '.join(f'{x:.2f}' for x in ratios)}"),
        Row(PART, f"events deleted by each retention run in the window, {label}", "events", deleted,
            note="runs began " + ", ".join(f"{r['lead']:+.1f}" for r in results) + " s after measuring began"),
    ]  # fmt: skip
    rows[1].decide(rows[1].ratio, "<= 2x")
    rows[2].decide(deleted, f">= {n // 8} events")
    if any(r["lead"] <= 0 for r in results):
        rows[1].status = rows[2].status = "MISS"
        rows[2].note += " (a run began before measuring: not a valid comparison)"
    return rows
