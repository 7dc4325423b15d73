"""Smoke run of the fleet part's paused-instance rows (``python -m bench fleet_paused --quick``, which ``fleet``
runs after its propagation rows): end to end on a real OpenBao (started and stopped by the bench), three
sidecars and the example traffic. No timing is asserted (the numbers live in docs/performance.md; the quick run
pauses 3 s with heartbeats every 0.5 s). What is asserted is a count: each instance paused across a phase
(begin, promote, retire) rejected no round once it woke, and its keystore requests after waking are reported."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.runner import run_part

PAUSED = [f"rejected rounds, one instance paused across {step}" for step in ("begin", "promote", "retire")]


def test_fleet_part_rejects_no_round_of_an_instance_paused_across_each_phase(tmp_path: Path) -> None:
    proc = run_part("fleet_paused", tmp_path)
    rows = {r["name"]: r for r in json.loads((tmp_path / "latest.json").read_text())["rows"]}
    assert list(rows) == PAUSED, proc.stderr[-2000:]
    for name in PAUSED:
        row = rows[name]
        assert (row["median"], row["target"], row["status"]) == (0.0, "== 0 rounds", "PASS"), row
        assert " 0 failed;" in row["note"] and "keystore requests after waking:" in row["note"], row["note"]
    for name in PAUSED:
        assert f"| fleet | {name} | 0 rounds |" in proc.stdout
