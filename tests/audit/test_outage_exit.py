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
import shutil
from pathlib import Path

import pytest
from bench.audit_log import fill

from tests.fixtures.audit import cli, sqlite_exec
from tests.fixtures.moto_kms import AWS_UNSET, aws_env
from tests.support.net import refused_port

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key

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


def test_verify_beside_a_running_prune_is_a_retry_not_a_broken_chain(tmp_path: Path) -> None:
    """A prune records its cut, then deletes: a verify reading meanwhile sees rows at or before the
    cut (``inserted``) or a gap (``deleted``). While the prune holds its lock, or once it has
    recorded a cut verify had not read, that is exit 75 (run again), not exit 1 (tampering); a
    prune that was really interrupted (the lock free) is still exit 1, as documented."""
    from mrtr_keys.audit.retention.prune import pruner_lock

    (tmp_path / "copy").mkdir()
    url, cps = f"sqlite://{tmp_path}/audit.db", tmp_path / "cp.jsonl"
    fill(url, 1_200, tx=100)
    shutil.copy(tmp_path / "audit.db", tmp_path / "copy" / "audit.db")  # same store id: its cut applies
    res = cli("audit", "prune", "--before", "30d", "--audit", f"sqlite://{tmp_path}/copy/audit.db",
              "--checkpoints", str(cps))  # fmt: skip
    assert res.code == 0, res.err
    args = ("audit", "verify", "--audit", url, "--checkpoints", str(cps))
    with pruner_lock(cps) as held:  # the state of the store while that prune deletes
        assert held
        res = cli(*args)
    assert res.code == 75 and res.out == "", (res.code, res.out, res.err)
    assert res.err.strip().splitlines() == [
        f"mrtr-keys: audit verify: a prune or archive of {cps} ran while verify read the store, so what it found "
        "(inserted) may be that prune's doing: run verify again when it has finished"
    ]
    res = cli(*args)
    assert res.code == 1 and res.out.startswith("BROKEN: inserted record") and "run audit prune again" in res.out


def test_a_damaged_instance_file_of_a_json_lines_store_is_a_break_not_an_outage(tmp_path: Path) -> None:
    """Presence in a JSON-lines store that is not JSON is damage (exit 1, one line), not "try later" (75)."""
    ring = tmp_path / "keyring.json"
    log = tmp_path / "audit.jsonl"
    assert cli("init", keystore=ring).code == 0
    (tmp_path / "audit.jsonl.instances.json").write_text("{not json")
    log.write_text("")
    res = cli("--audit", f"jsonl://{log}", "fleet", "status", keystore=ring)
    assert res.code == 1, (res.code, res.err)
    assert len(res.err.strip().splitlines()) == 1 and "Traceback" not in res.err
