"""Smoke run of the benchmark's stalled-connections part: it runs end to end against a real
sidecar with 1,000 stalled connections held and prints its two rows. No timing is asserted (the numbers live in
docs/performance.md); what is asserted is that the run had no errors and the stalled connections were held."""

from __future__ import annotations

from pathlib import Path

from tests.bench.runner import run_part


def test_stalled_part_prints_both_rows(tmp_path: Path) -> None:
    proc = run_part("stalled", tmp_path)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| stalled |")]
    assert [r.split(" | ")[1] for r in rows] == [
        "sidecar seal c=16 p99 without stalled connections",
        "sidecar seal c=16 p99 with 1000 stalled connections",
    ]
    assert "errors" not in rows[1] and "n/a" not in rows[1], rows[1]
