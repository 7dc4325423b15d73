"""`audit prune` keeps the proof, and the streaming `audit verify` (SQLite and PostgreSQL) still catches
every edit, deletion, insertion and reordering of what remains, and any deletion that is not a prune.

Logs are genuine (`bench.audit_log.fill`: the writer's own rows and chain), 4 000 events over the last
4 days, in transactions of a 24th of them on three chains, so a 3-day prune cuts every chain at a batch
boundary. (Four days, not forty: a PostgreSQL store makes a table for each day, and forty of them were
most of these tests' time.)
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from bench.audit_log import DAY, fill

from tests.fixtures.audit import cli, pg_exec, sqlite_exec

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key

EVENTS = 4_000
SPAN = 4 * DAY
"""Seconds the events are spread over, ending now."""
TX = EVENTS // 24
"""Events per transaction: each spans 1/24 of the `SPAN` the fill covers (4 hours), so a cut at 3 days
falls between whole batches of about a quarter of the log."""
BEFORE = "3d"
"""The prune's cut: a quarter of `SPAN` into the log."""


def _nth(n: int) -> str:
    """The storage id of the n-th remaining record (0-based)."""
    return f"(SELECT id FROM audit_events ORDER BY id LIMIT 1 OFFSET {n})"


COLUMNS = (
    "time, instance, client, audience, kid, op, outcome, reason, fingerprint, generation, duration_ms,"
    " writer, seq, prev_hash, hash"
)
TAMPER = {
    "deleted": (f"DELETE FROM audit_events WHERE id = {_nth(700)}",),
    "altered": (f"UPDATE audit_events SET reason = 'innocent' WHERE id = {_nth(700)}",),
    "inserted": (
        f"INSERT INTO audit_events ({COLUMNS}) SELECT {COLUMNS.replace('reason', chr(39) + 'forged' + chr(39))}"
        f" FROM audit_events WHERE id = {_nth(700)}",
    ),
    "reordered": (
        f"UPDATE audit_events SET id = id + 1000000 WHERE id = {_nth(700)}",
        f"UPDATE audit_events SET id = id - 1 WHERE id = {_nth(700)}",
        "UPDATE audit_events SET id = id - 1000000 + 1 WHERE id > 1000000",
    ),
}


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Callable[..., None]]:
    """(URL, execute) of an empty SQLite or PostgreSQL store."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/audit.db", sqlite_exec
    return request.getfixturevalue("postgres_url"), pg_exec


def _verify(url: str, cps: Path, *extra: str) -> dict[str, object]:
    res = cli("audit", "verify", "--audit", url, "--checkpoints", str(cps), "--json", *extra)
    doc = json.loads(res.out)
    assert res.code == (0 if doc["ok"] else 1), res.err
    return doc


def _pruned(url: str, tmp_path: Path) -> Path:
    cps = tmp_path / "checkpoints.jsonl"
    fill(url, EVENTS, tx=TX, span=SPAN)
    res = cli("audit", "prune", "--before", BEFORE, "--audit", url, "--checkpoints", str(cps), "--json")
    assert res.code == 0, res.err
    result = json.loads(res.out)
    assert (
        len(result["cuts"]) == 3 and EVENTS // 4 - TX <= result["deleted"] <= EVENTS // 4
    )  # whole batches of the first day's events
    return cps


def test_prune_then_verify_passes(store: tuple[str, Callable[..., None]], tmp_path: Path) -> None:
    url, _ = store
    cps = _pruned(url, tmp_path)
    doc = _verify(url, cps)
    assert doc["ok"] and doc["pruned_before"] and doc["chains"] == 3
    assert EVENTS * 3 // 4 <= int(doc["records"]) <= EVENTS - (EVENTS // 4 - TX)  # type: ignore[call-overload]
    # the cut is recorded with every chain's head (seq, batch hash, time) before anything was deleted
    cut = json.loads(cps.read_text().splitlines()[-1])
    assert cut["kind"] == "prune" and all({"writer", "seq", "hash", "time"} <= set(c) for c in cut["cuts"])
    # a second prune with the same cut-off deletes nothing more and verify still passes
    res = cli("audit", "prune", "--before", BEFORE, "--audit", url, "--checkpoints", str(cps), "--json")
    assert res.code == 0 and json.loads(res.out)["deleted"] == 0, res.err
    assert _verify(url, cps)["ok"]


@pytest.mark.parametrize("kind", ["deleted", "altered", "inserted", "reordered"])
def test_after_a_prune_tampering_with_what_remains_is_caught(
    kind: str, store: tuple[str, Callable[..., None]], tmp_path: Path
) -> None:
    url, execute = store
    cps = _pruned(url, tmp_path)
    execute(url, *TAMPER[kind])
    doc = _verify(url, cps)
    assert not doc["ok"]
    assert doc["first_break"]["kind"] == kind  # type: ignore[index]


def test_a_delete_that_is_not_a_prune_is_caught(store: tuple[str, Callable[..., None]], tmp_path: Path) -> None:
    url, execute = store
    fill(url, EVENTS, tx=TX, span=SPAN)
    cps = tmp_path / "checkpoints.jsonl"
    seq = EVENTS // 7  # about the middle of each of the 3 chains
    execute(url, f"DELETE FROM audit_events WHERE time < (SELECT MIN(time) FROM audit_events WHERE seq = {seq})")
    doc = _verify(url, cps)
    assert not doc["ok"] and doc["first_break"]["kind"] == "deleted"  # type: ignore[index]
    assert "missing" in doc["first_break"]["detail"]  # type: ignore[index]


def test_after_a_prune_deleting_older_kept_rows_by_hand_is_caught(
    store: tuple[str, Callable[..., None]], tmp_path: Path
) -> None:
    url, execute = store
    cps = _pruned(url, tmp_path)
    execute(url, f"DELETE FROM audit_events WHERE id <= {_nth(999)}")  # the oldest kept rows, not by a prune
    doc = _verify(url, cps)
    assert not doc["ok"] and doc["first_break"]["kind"] == "deleted"  # type: ignore[index]
    assert "not removed by a prune" in doc["first_break"]["detail"]  # type: ignore[index]


def test_prune_refuses_a_broken_log_and_deletes_nothing(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    fill(url, EVENTS, tx=TX, span=SPAN)
    sqlite_exec(url, f"UPDATE audit_events SET reason = 'innocent' WHERE id = {_nth(10)}")
    res = cli("audit", "prune", "--before", BEFORE, "--audit", url, "--checkpoints", str(tmp_path / "cp.jsonl"))
    assert res.code != 0 and "not pruning" in res.err and "altered" in res.err
    assert len(res.err.strip().splitlines()) == 1
    assert not (tmp_path / "cp.jsonl").exists()
    conn = sqlite3.connect(url.removeprefix("sqlite://"))
    assert conn.execute("SELECT COUNT(*) FROM audit_events").fetchone()[0] == EVENTS
    conn.close()


def test_prune_refuses_a_jsonl_log(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    fill(f"jsonl://{path}", 100)
    res = cli("audit", "prune", "--before", "30d", "--audit", f"jsonl://{path}", "--checkpoints", str(tmp_path / "cp"))
    assert res.code == 2 and "log shipper" in res.err


def test_verify_since_a_checkpoint_starts_at_its_heads(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    cps = tmp_path / "checkpoints.jsonl"
    fill(url, 3_000, tx=500, span=3 * 86_400, start=1_700_000_000.0)
    assert cli("audit", "checkpoint", "--audit", url, "--checkpoints", str(cps)).code == 0
    fill(url, 2_000, tx=500, host="later-host", span=86_400, start=1_700_300_000.0)
    # an edit before the checkpoint: a full verify sees it, a verify since the checkpoint does not look there
    sqlite_exec(url, f"UPDATE audit_events SET reason = 'innocent' WHERE id = {_nth(10)}")
    assert _verify(url, cps)["ok"] is False
    doc = _verify(url, cps, "--since", "last")
    assert doc["ok"] and doc["since"] and doc["records"] == 2_000 and doc["checkpoints_checked"] == 3
    # an edit after it is caught
    sqlite_exec(url, f"UPDATE audit_events SET reason = 'innocent' WHERE id = {_nth(4_000)}")
    doc = _verify(url, cps, "--since", "last")
    assert doc["first_break"]["kind"] == "altered"  # type: ignore[index]
    # no checkpoint that early: one line, exit 2
    res = cli("audit", "verify", "--audit", url, "--checkpoints", str(cps), "--since", "2020-01-01")
    assert res.code == 2 and "no checkpoint at or before" in res.err


def test_after_a_prune_verify_since_last_starts_at_the_newest_checkpoint(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    cps = tmp_path / "checkpoints.jsonl"
    fill(url, 3_000, tx=500, span=3 * 86_400, start=1_700_000_000.0)  # 2023-11-14T22:13Z onwards
    assert cli("audit", "checkpoint", "--audit", url, "--checkpoints", str(cps)).code == 0
    fill(url, 2_000, tx=500, host="later-host", span=86_400, start=1_700_300_000.0)
    res = cli("audit", "prune", "--before", "2023-11-16", "--audit", url, "--checkpoints", str(cps), "--json")
    assert res.code == 0 and json.loads(res.out)["deleted"] >= 500, res.err
    doc = _verify(url, cps, "--since", "last")  # the checkpoint's heads, not the prune's cuts
    assert doc["ok"] and doc["records"] == 2_000 and doc["pruned_before"] == "2023-11-16T00:00:00.000000Z"
    full = _verify(url, cps)
    assert full["ok"] and int(full["records"]) == 5_000 - json.loads(res.out)["deleted"]  # type: ignore[call-overload]


def test_the_old_to_spelling_of_checkpoints_still_works_with_a_note(tmp_path: Path) -> None:
    """`audit prune --to` / `audit checkpoint --to` were renamed --checkpoints (as `audit archive` names its
    checkpoint file); the old spelling keeps working for scripts, with a one-line note on stderr."""
    url = f"sqlite://{tmp_path}/audit.db"
    cps = tmp_path / "checkpoints.jsonl"
    fill(url, 3_000, tx=500, span=3 * 86_400, start=1_700_000_000.0)
    done = cli("audit", "checkpoint", "--audit", url, "--to", str(cps), "--json")
    assert done.code == 0 and json.loads(done.out)["written_to"] == str(cps), done.err
    assert done.err.strip() == "mrtr-keys: note: audit checkpoint --to is now --checkpoints (--to still works)"
    res = cli("audit", "prune", "--before", "2023-11-16", "--audit", url, "--to", str(cps))
    assert res.code == 0 and f"cut recorded in {cps}" in res.out, res.err
    assert res.err.strip() == "mrtr-keys: note: audit prune --to is now --checkpoints (--to still works)"
    assert _verify(url, cps)["ok"]
