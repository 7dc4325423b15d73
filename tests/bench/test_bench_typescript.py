"""Smoke run of the benchmark's ``typescript`` part with tiny counts (``python -m bench typescript --quick``):
it starts its sidecar, runs the Node timing script and prints every row. No timing is asserted (a shared
machine would make that flaky); the figures live in bench/results and the closing note of issue 24.
Without node the part must say so in one n/a row, and the run still succeeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.runner import run_part
from tests.typescript.stack import NODE

pytestmark = pytest.mark.e2e


def test_typescript_part_prints_and_saves_every_row(tmp_path: Path) -> None:
    proc = run_part("typescript", tmp_path)
    if NODE is None:
        assert "| typescript | TS sidecar mint+verify | - |" in proc.stdout and "node not on PATH" in proc.stdout
        return
    for c in (1, 16):
        for name in (
            f"TS sidecar mint+verify c={c} p50",
            f"TS sidecar mint+verify c={c} p99",
            f"2x keep-alive POST /healthz c={c} p50",
            f"TS SDK createRequestStateCodec mint+verify c={c} p50",
        ):
            assert f"| typescript | {name} |" in proc.stdout, name
    rows = {r["name"]: r for r in json.loads((tmp_path / "latest.json").read_text())["rows"]}
    p50 = rows["TS sidecar mint+verify c=1 p50"]
    assert p50["target"] == "<= 1.5x" and p50["status"] in ("PASS", "MISS") and p50["ratio"] > 0
