"""Smoke run of the benchmark's single-use part with tiny counts: it runs end to end on the local
Redis and a throwaway PostgreSQL database and prints every row with a verdict. No timing is asserted."""

from __future__ import annotations

from pathlib import Path

from tests.bench.runner import run_part


def test_single_use_part_prints_every_row(tmp_path: Path) -> None:
    proc = run_part("single_use", tmp_path)
    for name in (
        "plain unseal (Redis run)",
        "raw SET NX PX (redis-py)",
        "single-use unseal (Redis) vs plain",
        "raw INSERT ON CONFLICT DO NOTHING (psycopg)",
        "single-use unseal (PostgreSQL) vs plain",
    ):
        assert f"| single_use | {name} |" in proc.stdout, name
    for store, raw in (("Redis", "raw SET NX PX (redis-py)"), ("PostgreSQL", "raw INSERT ON CONFLICT DO NOTHING")):
        line = next(
            x for x in proc.stdout.splitlines() if x.startswith(f"| single_use | single-use unseal ({store}) |")
        )
        assert raw in line and "<= 1.2x" in line and ("PASS" in line or "MISS" in line)
