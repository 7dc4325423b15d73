"""Part 6: resident memory of the sidecar after 1k operations vs after `--ops` (default 1,000,000).

One sidecar worker (so its RSS is one process's), a local ring. Operations are driven
through the batch endpoints (seal a batch, unseal the tokens just made), so a million
operations take minutes, not hours. RSS is read from /proc (the worker and any children)
after 1k operations (warm: imports, first allocations done) and at the end, with a few
checkpoints between. Bound: growth below `BOUND_MB`.
"""

from __future__ import annotations

import base64
import time

import httpx

from bench.common import Settings, envelope_payload
from bench.report import Row
from bench.services import AUDIENCE, Services, module_available, rss_kib

PART = "memory"
BOUND_MB = 20.0
BATCH = 250


def run(services: Services, settings: Settings) -> list[Row]:
    name = f"sidecar RSS growth, 1k -> {settings.memory_ops:,} ops"
    if not module_available("mrtr_keys.service.app"):
        return [Row.missing(PART, name, "n/a (not built): mrtr_keys.service", target=f"< {BOUND_MB:g} MB")]
    from bench.sidecar_load import start_sidecar

    sidecar = start_sidecar(services, workers=1, name="memory-sidecar")
    payload = base64.urlsafe_b64encode(envelope_payload()).rstrip(b"=").decode()
    headers = {"Authorization": f"Bearer {sidecar.secret}"}
    seal_body = {"items": [{"audience": AUDIENCE, "payload": payload}] * BATCH}
    done = 0
    checkpoints: list[tuple[int, int]] = []
    started = time.monotonic()
    with httpx.Client(base_url=sidecar.url, headers=headers, timeout=60) as client:

        def cycle(batch: int) -> None:
            nonlocal done
            body = seal_body if batch == BATCH else {"items": seal_body["items"][:batch]}
            r = client.post("/v1/seal/batch", json=body)
            r.raise_for_status()
            tokens = [item["token"] for item in r.json()["results"]]
            r = client.post("/v1/unseal/batch", json={"items": [{"audience": AUDIENCE, "token": t} for t in tokens]})
            r.raise_for_status()
            assert all("payload" in item for item in r.json()["results"])
            done += 2 * batch

        while done < 1000:
            cycle(100)
        base = rss_kib(sidecar.pid)
        checkpoints.append((done, base))
        marks = [m for m in (10_000, 100_000, 300_000) if m < settings.memory_ops]
        while done < settings.memory_ops:
            cycle(min(BATCH, max(1, (settings.memory_ops - done) // 2)))
            if marks and done >= marks[0]:
                checkpoints.append((done, rss_kib(sidecar.pid)))
                marks.pop(0)
        end = rss_kib(sidecar.pid)
        checkpoints.append((done, end))
    growth_mb = (end - base) / 1024
    row = Row(PART, name, "MB", growth_mb, anchor=f"RSS after {checkpoints[0][0]:,} ops", ratio=end / base)
    trail = ", ".join(f"{n:,}: {kib / 1024:.1f}" for n, kib in checkpoints)
    row.note = f"RSS MB at ops {trail}; {time.monotonic() - started:.0f} s; batches of {BATCH}, 1 worker"
    return [row.decide(growth_mb, f"< {BOUND_MB:g} MB")]
