"""Cron can tell an outage from a break: `audit verify`, `prune`, `archive` and `checkpoint` exit 75
(EX_TEMPFAIL, "unavailable", as ``fleet status`` and the writers use for a held lock) when the store
or the archive cannot be reached, and 1 only for a broken chain (docs/audit.md, the runbook).

The unreachable store is a PostgreSQL URL on a port that refuses connections (bound, never
listening: `tests.support.net.refused_port`); the unreachable archive an S3 endpoint on such a port.
A broken chain exiting 1 is tests/audit/test_prune.py's `_verify` (and test_archive's damaged
archives); here it is checked once more beside the outage, on the same command.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench.audit_log import fill

from tests.fixtures.audit import cli, sqlite_exec
from tests.fixtures.moto_kms import AWS_UNSET, aws_env
from tests.support.net import refused_port

COMMANDS = {
    "verify": ("audit", "verify"),
    "prune": ("audit", "prune", "--before", "30d"),
    "archive": ("audit", "archive", "--before", "30d", "--to", "ARCHIVE"),
    "checkpoint": ("audit", "checkpoint"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unreachable_store_exits_75_in_one_line(command: str, tmp_path: Path) -> None:
    args = [a.replace("ARCHIVE", str(tmp_path / "archive")) for a in COMMANDS[command]]
    cps = str(tmp_path / "checkpoints.jsonl")
    with refused_port() as port:
        url = f"postgresql://postgres@127.0.0.1:{port}/mrtr_audit"
        res = cli(*args, "--audit", url, "--checkpoints", cps)
    assert res.code == 75, (res.code, res.err)
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and "cannot connect to the audit store" in lines[0] and "Traceback" not in res.err


def test_an_unreachable_s3_archive_exits_75_and_a_broken_chain_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, cps = f"sqlite://{tmp_path}/audit.db", str(tmp_path / "checkpoints.jsonl")
    fill(url, 600, tx=100)
    for name in AWS_UNSET:
        monkeypatch.delenv(name, raising=False)
    with refused_port() as port:
        for name, value in aws_env(f"http://127.0.0.1:{port}").items():
            monkeypatch.setenv(name, value)
        res = cli("audit", "verify", "--audit", url, "--checkpoints", cps, "--from-archive", "s3://audit-bucket/a")
    assert res.code == 75 and "cannot list s3://audit-bucket" in res.err, (res.code, res.err)
    sqlite_exec(url, "UPDATE audit_events SET reason = 'innocent' WHERE id = 300")
    res = cli("audit", "verify", "--audit", url, "--checkpoints", cps, "--json")
    assert res.code == 1 and json.loads(res.out)["first_break"]["kind"] == "altered", res.err
