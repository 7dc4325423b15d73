"""Part: the TypeScript client (clients/typescript, docs/typescript.md): what a round costs a TS MCP server.

One round is ``mint`` then ``verify`` (a seal and an unseal), timed per round by
clients/typescript/bench/typescript.ts in Node at concurrency 1 and 16, three subjects interleaved
per repeat:

* ``TS sidecar mint+verify``: `createSidecarRequestStateCodec` through ``mrtr-keys serve`` (one worker,
  loopback TCP, keep-alive, the audit log on as shipped): two HTTP requests a round;
* the anchor, the transport floor: two bare keep-alive ``POST /healthz`` to the same sidecar with the same
  Node HTTP agent settings (same requests a round, no sealing, no auth, no JSON work);
* ``TS SDK createRequestStateCodec mint+verify``: the SDK's in-process HMAC codec (no I/O), for context.

p50 and p99 are over every round of a repeat; the row is the median over repeats, the ratio the median
of per-repeat sidecar/floor ratios. Target: sidecar p50 within 1.5x of the floor (issue 24).
Without ``node`` on PATH the part prints one line and gives one ``n/a`` row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench.common import Settings
from bench.report import Row, spread_of
from bench.services import AUDIENCE, Services
from bench.sidecar_load import start_sidecar
from bench.timing import median

PART = "typescript"
LEVELS = (1, 16)
TARGET = "<= 1.5x"


def run(services: Services, settings: Settings) -> list[Row]:
    from tests.typescript.stack import BUILD, NODE, ensure_built

    if NODE is None:
        print("[bench] typescript: not run, node is not on PATH", file=sys.stderr)
        return [Row.missing(PART, "TS sidecar mint+verify", "n/a (node not on PATH)", target=TARGET)]
    ensure_built()
    sidecar = start_sidecar(services, workers=1, name="typescript")
    rounds, repeats = (20, 1) if settings.quick else (600, 5)
    env = {
        **os.environ,
        "MRTR_KEYS_SIDECAR_URL": sidecar.url,
        "MRTR_KEYS_SIDECAR_SECRET": sidecar.secret,
        "MRTR_BENCH_AUDIENCE": AUDIENCE,
    }
    argv = [NODE, str(BUILD.parent.parent / "bench" / "typescript.js")]
    argv += ["--concurrency", ",".join(map(str, LEVELS)), "--rounds", str(rounds), "--repeats", str(repeats)]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"typescript bench failed: {proc.stderr[-2000:]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    rows: list[Row] = []
    for c in LEVELS:
        level = data[f"c{c}"]
        side, floor, hmac = level["sidecar"], level["floor"], level["hmac"]
        for q in ("p50", "p99"):
            ratios = [s / f for s, f in zip(side[q], floor[q], strict=True) if f > 0]
            row = Row(
                PART,
                f"TS sidecar mint+verify c={c} {q}",
                "ms",
                median(side[q]),
                spread_of(side[q]),
                f"2x keep-alive POST /healthz c={c} {q}",
                median(ratios) if ratios else None,
                samples=list(side[q]),
            )
            rows.append(row.decide(row.ratio, TARGET) if q == "p50" else row)
        for q in ("p50", "p99"):
            rows.append(
                Row(PART, f"2x keep-alive POST /healthz c={c} {q}", "ms", median(floor[q]), spread_of(floor[q]))
            )
        rows.append(
            Row(
                PART,
                f"TS SDK createRequestStateCodec mint+verify c={c} p50",
                "ms",
                median(hmac["p50"]),
                spread_of(hmac["p50"]),
                note="in-process HMAC, no I/O",
            )
        )
    return rows
