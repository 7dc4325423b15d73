"""Smoke run of the benchmark's audit part (``python -m bench audit --quick``): it runs end to end
(its own sidecars, PostgreSQL, a stand-in writer process) and prints every row, the co-location
rows among them. No timing is asserted (the numbers live in docs/performance.md); what is asserted
is the set of rows, that no audit event was dropped, and that no request failed."""

from __future__ import annotations

from pathlib import Path

from tests.bench.runner import run_part

SIDECAR = ["sidecar seal c=16", "sidecar seal batch(100) c=16"]


def test_audit_part_prints_every_row_with_nothing_dropped(tmp_path: Path) -> None:
    proc = run_part("audit", tmp_path)
    rows = {r.split(" | ")[1]: r for r in proc.stdout.splitlines() if r.startswith("| audit |")}
    expected = [
        "local seal+unseal, audit off",
        "local seal+unseal, audit on",
        "local seal+unseal, audit on, queueing only",
        "bare executemany of the same rows, SQLite",
        "audit writer, SQLite",
        "bare COPY of the same rows, PostgreSQL",
        "audit writer, PostgreSQL",
    ]
    for s in SIDECAR:
        expected += [
            f"{s}, audit off",
            f"{s}, audit on",
            f"{s}, audit off beside a writer process at the audit-on rate",
            f"{s}, audit on, own share",
        ]
    assert list(rows) == expected
    assert all("| n/a |" not in r for r in rows.values())
    assert "0 dropped" in rows["local seal+unseal, audit on"]
    for s in SIDECAR:
        assert "audit events dropped so far 0," in rows[f"{s}, audit on"], rows[f"{s}, audit on"]
        assert "numbers not valid" not in rows[f"{s}, audit on"]
        assert "a real writer process took" in rows[f"{s}, audit off beside a writer process at the audit-on rate"]
