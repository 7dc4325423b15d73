"""Part 7 (``fleet``): how fast a fleet follows a key ring change, and what watching costs the keystore.

Five instance processes (`bench.fleet_worker`: `mrtr_keys.request_state_security` with every default:
a cheap keystore check every 2 s with jitter, a full read only on change, presence heartbeats into the
default SQLite audit store) share one file key ring. The bench makes 10 phase changes (begin, promote,
retire, ...; retire forced past the TTL, which is not what is measured) at random moments, and for each
measures the time from the keystore write (the save returned) to the last instance's heartbeat at the
new generation, from the presence rows (each instance writes one at once when it loads a generation).
Reported: p50 and p99 of that time (target: p99 <= 3 s with defaults) and, from each instance's
watcher, cheap checks and full keystore reads per instance per minute.

Then the revocations (`bench.fleet_revoke`): how fast a revoked primary dies on five instances carrying
rounds, and the rounds refused against ``keys revoke``'s estimate. Then the paused instances
(`bench.fleet_paused`): rejected rounds with one instance paused 20 s across each phase (target 0), with the
waits of each step and the paused instance's keystore requests.

Anchors for the note (vendors' defaults; none confirms that an instance has loaded the change): Vault
Agent re-renders templates of static secrets about every 5 minutes, the AWS Secrets Manager caching
client refreshes hourly, a mounted Kubernetes Secret follows the kubelet's sync period (about a minute).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import fleet_paused, fleet_revoke
from bench.common import Settings
from bench.report import Row, spread_of
from bench.services import REPO, Services

PART = "fleet"
INSTANCES = 5
CHANGES = 10
ANCHORS = (
    "anchors (vendor defaults, none confirms a load): Vault Agent static-secret re-render ~5 min, "
    "AWS Secrets Manager caching client 1 h, kubelet Secret sync ~1 min"
)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def _wait_all(store: Any, names: set[str], generation: int, timeout: float = 60.0) -> dict[str, float]:
    """name -> POSIX time of its first heartbeat at `generation` or later (polled every 20 ms)."""
    from mrtr_keys.audit.events import parse_event_time
    from mrtr_keys.fleet.presence import read_instances

    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < len(names):
        for rec in read_instances(store):
            if rec.name in names and rec.name not in seen and (rec.generation or 0) >= generation:
                seen[rec.name] = parse_event_time(rec.beat).timestamp()
        if time.monotonic() > deadline:
            raise TimeoutError(f"instances at generation {generation} after {timeout} s: {sorted(seen)}")
        time.sleep(0.02)
    return seen


@contextlib.contextmanager
def workers(ring: Path, names: set[str], counters: list[dict[str, Any]], *args: str) -> Iterator[None]:
    """`bench.fleet_worker` processes on `ring`, one a name in `names` (extra worker arguments `args`), ready
    when the block starts; on exit their stdin is closed and each one's counters are appended to `counters`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRTR_KEYS_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.fleet_worker", str(ring), name, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for name in sorted(names)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a fleet worker did not start")
        yield
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs:
            try:
                assert proc.stdout is not None
                out = proc.stdout.read()
                proc.wait(timeout=30)
                counters.append(json.loads(out.strip().splitlines()[-1]))
            except Exception:
                proc.kill()
                proc.wait()


def run(services: Services, settings: Settings) -> list[Row]:
    from mrtr_keys.audit.writing.stores.url import default_url, open_store
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.changes.rotation import run_step
    from mrtr_keys.keystores.file import FileKeystore

    changes = 3 if settings.quick else CHANGES
    workdir = Path(services.workdir) / "fleet"
    workdir.mkdir(parents=True, exist_ok=True)
    ring = workdir / "keyring.json"
    keystore = FileKeystore(ring)
    create_ring(keystore)
    names = {f"bench-{i}" for i in range(1, INSTANCES + 1)}
    latencies: list[float] = []
    counters: list[dict[str, Any]] = []
    with workers(ring, names, counters):
        store = open_store(default_url(workdir))
        rng = random.Random(11)
        try:
            _wait_all(store, names, keystore.load().generation)
            for _ in range(changes):
                time.sleep(rng.uniform(0.3, 2.3))  # land at a random point of the instances' check cycles
                result = run_step(keystore, "next", force=True)
                written = time.time()
                seen = _wait_all(store, names, result.ring.generation)
                latencies.append(max(seen.values()) - written)
        finally:
            store.close()
    p50 = statistics.median(latencies)
    p99 = _percentile(latencies, 0.99)
    checks = [c["checks"] / c["seconds"] * 60 for c in counters if c["seconds"] > 0]
    reads = [c["reads"] / c["seconds"] * 60 for c in counters if c["seconds"] > 0]
    per_change = [c["reads"] / changes for c in counters]  # includes the one read of the first check
    minutes = statistics.median(c["seconds"] for c in counters) / 60 if counters else 0
    name = f"keystore write -> last of {INSTANCES} instances' heartbeat at the new generation"
    rows = [
        Row(
            PART,
            f"{name}, p50",
            "s",
            p50,
            spread_of(latencies),
            note=f"{changes} phase changes; {ANCHORS}",
            samples=latencies,
        ),
        Row(PART, f"{name}, p99", "s", p99, spread_of(latencies), samples=latencies).decide(p99, "<= 3 s"),
        Row(
            PART,
            "keystore full reads per instance per minute",
            "/min",
            statistics.median(reads) if reads else None,
            spread_of(reads),
            note=f"{changes} changes in {minutes:.1f} min; a read only when the ring changed",
        ),
        Row(
            PART,
            "keystore full reads per instance per ring change",
            "",
            statistics.median(per_change) if per_change else None,
            spread_of(per_change),
            note="1.0-1.1: one full read per change plus the first check's; none while nothing changes",
        ),
        Row(
            PART,
            "keystore cheap checks per instance per minute",
            "/min",
            statistics.median(checks) if checks else None,
            spread_of(checks),
            note="one stat() of the ring file every 2 s +-20 %",
        ),
    ]
    return rows + fleet_revoke.run(services, settings) + fleet_paused.run(services, settings)
