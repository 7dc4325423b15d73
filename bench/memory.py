"""Part 6: resident memory of the sidecar after 1k operations vs after `--ops` (default 1,000,000).

One sidecar worker (so its RSS is one process's), a local ring. Operations are driven
through the batch endpoints (seal a batch, unseal the tokens just made), so a million
operations take minutes, not hours. RSS is read from /proc (the worker and every
descendant, including the audit writer process, which the sidecar starts from a thread: its
pid is listed under that thread's ``/proc/PID/task/TID/children``, not the main thread's; the
sidecar starts it at start-up) after 1k operations (warm: imports, first allocations done) and at
the end, with a few
checkpoints between. Bound: growth below `BOUND_MB`. The note says whether the audit log was
on (the sidecar's default, ``MRTR_KEYS_AUDIT`` unset), splits the growth between the sidecar
process and its audit writer, and gives the audit queue's high-water mark and drops (scraped
from ``/metrics`` every 10k operations).
"""

from __future__ import annotations

import base64
import os
import re
import time
from pathlib import Path

import httpx

from bench.common import Settings, envelope_payload
from bench.report import Row
from bench.services import AUDIENCE, Services, module_available

PART = "memory"
BOUND_MB = 20.0
BATCH = 250


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _tree(pid: int) -> list[int]:
    """`pid` and all its descendants, following the children of every thread (task)."""
    out = [pid]
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for c in children:
            out.extend(_tree(int(c)))
    return out


def rss_split(pid: int) -> tuple[int, int]:
    """(RSS of `pid`, RSS of all its descendants) in KiB."""
    own, rest = 0, 0
    for p in _tree(pid):
        try:
            kib = _rss(p)
        except OSError:
            continue
        if p == pid:
            own += kib
        else:
            rest += kib
    return own, rest


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

        queue_max, dropped, scraped = 0.0, 0.0, 0
        audit_on = False

        def scrape() -> None:
            nonlocal queue_max, dropped, audit_on
            text = client.get("/metrics").text
            m = re.search(r"^mrtr_sidecar_audit_queued (\S+)$", text, re.M)
            if m:
                audit_on = True
                queue_max = max(queue_max, float(m.group(1)))
            m = re.search(r"^mrtr_sidecar_audit_dropped_total (\S+)$", text, re.M)
            if m:
                dropped = float(m.group(1))

        while done < 1000:
            cycle(100)
        scrape()
        base = rss_split(sidecar.pid)
        checkpoints.append((done, base))
        marks = [m for m in (10_000, 100_000, 300_000) if m < settings.memory_ops]
        while done < settings.memory_ops:
            cycle(min(BATCH, max(1, (settings.memory_ops - done) // 2)))
            if done // 10_000 > scraped:
                scraped = done // 10_000
                scrape()
            if marks and done >= marks[0]:
                checkpoints.append((done, rss_split(sidecar.pid)))
                marks.pop(0)
        scrape()
        end = rss_split(sidecar.pid)
        checkpoints.append((done, end))
    growth_mb = (sum(end) - sum(base)) / 1024
    row = Row(PART, name, "MB", growth_mb, anchor=f"RSS after {checkpoints[0][0]:,} ops", ratio=sum(end) / sum(base))
    trail = ", ".join(f"{n:,}: {own / 1024:.1f}+{kids / 1024:.1f}" for n, (own, kids) in checkpoints)
    audit = (
        f"audit ON (writer process; queue high-water {queue_max:,.0f} events, {dropped:,.0f} dropped)"
        if audit_on
        else "audit off"
    )
    row.note = (
        f"{audit}; RSS MB sidecar+children at ops {trail}; growth sidecar "
        f"{(end[0] - base[0]) / 1024:.1f} MB, children {(end[1] - base[1]) / 1024:.1f} MB; "
        f"{time.monotonic() - started:.0f} s; batches of {BATCH}, 1 worker; load {os.getloadavg()[0]:.1f}"
    )
    return [row.decide(growth_mb, f"< {BOUND_MB:g} MB")]
