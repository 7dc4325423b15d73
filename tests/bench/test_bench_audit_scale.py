"""Smoke run of the benchmark's audit_scale part (``python -m bench audit_scale --quick``): a genuine log
filled, verified, looked up (gate, --kid, --token), pruned, archived and verified again (also from the
archive) by the CLI, at two sizes, a PostgreSQL log verified, then a sidecar's own retention run measured
under traffic, and every row printed. No timing is asserted (the 1 M / 5 M figures are measured by
``make bench``); a failed verify or retention run would fail the part."""

from __future__ import annotations

from pathlib import Path

from tests.bench.runner import run_part


def test_audit_scale_part_prints_every_row(tmp_path: Path) -> None:
    proc = run_part("audit_scale", tmp_path)
    rows = [r.split(" | ")[1] for r in proc.stdout.splitlines() if r.startswith("| audit_scale |")]
    for n in ("10,000", "40,000"):
        for name in (
            "audit verify",
            "audit verify peak RSS",
            "bytes per event",
            "audit prune --before 35d",
            "audit archive export (segments + manifest)",
            "audit archive --before 30d (walk + export + prune)",
            "audit verify --from-archive",
        ):
            assert f"{name}, {n} events" in rows, proc.stdout
        for name in (
            "rotate retire gate query (kid sealing)",
            "audit query --token (fingerprint lookup)",
            "audit stats --by instance (hourly totals)",
            "audit stats --by reason --since 7d --op seal (totals + edge hour)",
        ):
            assert f"{name}, {n} events" in rows, proc.stdout
    assert "verify RSS growth, 4x the events" in rows
    assert (
        "audit verify, 20,000 events, PostgreSQL" in rows and "audit verify peak RSS, 20,000 events, PostgreSQL" in rows
    )
    assert "audit query --kid K --limit 20 (CLI) growth, 4x the events" in rows
    assert "audit stats --by instance (hourly totals) growth, 4x the events" in rows
    # a running sidecar's own retention prunes while a client measures (bench.audit_retention)
    for name in (
        "seal+unseal p99 outside the prune (anchor)",
        "seal+unseal p99 during a retention prune",
        "events deleted by each retention run in the window",
    ):
        assert f"{name}, 10,000 events over 40 days" in rows, proc.stdout
    assert "(part failed)" not in proc.stdout
