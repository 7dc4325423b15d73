"""Smoke run of the benchmark's in-process part with tiny counts.

It checks that `python -m bench inprocess --quick` runs end to end on real services (it
starts moto and OpenBao itself and stops them), prints one table with every in-process
row, and writes the same rows as JSON. No timing is asserted: on a shared machine that
would be a flaky test; the numbers live in docs/performance.md. What is asserted beside
the shape is a count, not a time: the data-key codecs made zero remote calls per token.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.runner import run_part

EXPECTED_ROWS = [
    "raw AES-GCM seal",
    "SDK built-in seal",
    "local seal",
    "KMS datakey seal",
    "Vault datakey seal",
    "local unseal",
    "SDK built-in unseal",
    "raw AES-GCM seal+unseal",
    "SDK built-in seal+unseal",
    "local seal+unseal",
    "KMS datakey seal+unseal",
    "Vault datakey seal+unseal",
    "base64url encode+decode only seal+unseal",
    "local seal+unseal, 16 KiB payload",
    "KMS datakey remote calls while timing",
    "Vault datakey remote calls while timing",
]


def test_inprocess_part_prints_and_saves_every_row(tmp_path: Path) -> None:
    proc = run_part("inprocess", tmp_path)
    table = proc.stdout
    assert table.startswith("| part | row | median |")
    for name in EXPECTED_ROWS:
        assert f"| inprocess | {name} |" in table, name

    saved = json.loads((tmp_path / "latest.json").read_text())
    rows = saved["rows"]
    assert {r["name"] for r in rows} >= set(EXPECTED_ROWS)
    assert saved["machine"]["nproc"] >= 1
    # Every row with a target got a verdict; none is "n/a" now that every codec exists.
    targeted = [r for r in rows if r["target"]]
    assert {r["name"] for r in targeted} >= {
        "local seal+unseal",
        "KMS datakey seal+unseal",
        "Vault datakey seal+unseal",
    }
    assert all(r["status"] in ("PASS", "MISS") for r in targeted), [(r["name"], r["note"]) for r in targeted]
    # Zero remote calls per token is a count, not a timing: it must hold on any machine.
    calls = {r["name"]: r for r in rows if r["name"].endswith("remote calls while timing")}
    assert set(calls) == {"KMS datakey remote calls while timing", "Vault datakey remote calls while timing"}
    for row in calls.values():
        assert row["median"] == 0.0
        assert row["status"] == "PASS"
    # The timestamped file and latest.json hold the same run.
    stamped = [p for p in tmp_path.glob("*.json") if p.name != "latest.json"]
    assert len(stamped) == 1
    assert json.loads(stamped[0].read_text()) == saved
