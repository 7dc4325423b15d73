"""Item 5 of issue 26: ``audit query`` streams its output, ``--kid`` alone and ``--token`` (the
fingerprint) are found through an index (schema 5: one probe a bucket of storage positions, issue 41), and
the output is what it was for a short result."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from bench.audit_log import fill

from mrtr_keys.audit.writing.stores.base import Query
from mrtr_keys.audit.writing.stores.narrow import fingerprint_clause
from mrtr_keys.audit.writing.stores.url import open_store
from tests.fixtures.audit import cli

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key

EVENTS = 2_600


def _plan(path: Path, where: str) -> str:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(f"EXPLAIN QUERY PLAN SELECT * FROM audit_events WHERE {where} ORDER BY id").fetchall()
    finally:
        conn.close()
    return " | ".join(str(r[-1]) for r in rows)


def test_query_streams_a_long_result_and_kid_and_token_use_an_index(tmp_path: Path) -> None:
    path = tmp_path / "audit.db"
    url = f"sqlite://{path}"
    fill(url, EVENTS, tx=500)
    store = open_store(url)
    try:
        every = [r.event.to_json() for r in store.query(Query(kid="1a2b3c4d"))]
        fp = every[100]["fingerprint"]
        by_token = [r.event.to_json() for r in store.iter_query(Query(fingerprint=fp))]
    finally:
        store.close()
    # --json: one array, written as it is read, the same text as before for the same events
    res = cli("audit", "query", "--audit", url, "--kid", "1a2b3c4d", "--json")
    assert res.code == 0, res.err
    assert res.out == json.dumps(every, indent=2) + "\n" and len(every) == EVENTS
    empty = cli("audit", "query", "--audit", url, "--kid", "ffffffff", "--json")
    assert empty.code == 0 and empty.out == "[]\n"
    # a table longer than one chunk prints as consecutive tables and says how many at the end
    table = cli("audit", "query", "--audit", url, "--op", "seal")
    assert table.code == 0 and "events 1-1000" in table.out and "events 1001-1300" in table.out
    assert table.err.strip() == "mrtr-keys: 1300 events"
    # --token's fingerprint and --kid alone are looked up through indexes (schema 5), not a table scan
    assert by_token and all(e["fingerprint"] == fp for e in by_token)
    where = fingerprint_clause(5).replace("?", f"x'{fp[:8]}'", 1).replace("?", f"x'{fp}'")  # stored as 12 bytes
    assert "SEARCH audit_events USING INDEX audit_events_fpb" in _plan(path, where)
    assert _plan(path, "kid = '1a2b3c4d'") == "SEARCH audit_events USING INDEX audit_events_kid (kid=?)"  # no sort


def test_checkpoint_reads_only_what_was_added_since_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mrtr_keys.audit.verifying import checkpoint_since

    monkeypatch.setattr(checkpoint_since, "OVERLAP", 0)  # the re-read margin, here none: exact counts
    url, cps = f"sqlite://{tmp_path}/audit.db", tmp_path / "cp.jsonl"
    fill(url, 3_000, tx=500)
    first = json.loads(cli("audit", "checkpoint", "--audit", url, "--checkpoints", str(cps), "--json").out)
    assert first["read_from"] == 0 and first["position"] == 3_000 and len(first["heads"]) == 3
    fill(url, 1_000, tx=500, host="later-host")
    second = json.loads(cli("audit", "checkpoint", "--audit", url, "--checkpoints", str(cps), "--json").out)
    assert second["read_from"] == 3_000 and second["position"] == 4_000
    full = json.loads(cli("audit", "checkpoint", "--audit", url, "--checkpoints", str(cps), "--full", "--json").out)
    assert full["read_from"] == 0 and sorted(map(str, full["heads"])) == sorted(map(str, second["heads"]))
    assert len(second["heads"]) == 5
    doc = json.loads(cli("audit", "verify", "--audit", url, "--checkpoints", str(cps), "--json").out)
    assert doc["ok"] and doc["checkpoints_checked"] == 13


def test_narrow_sqlite_rows_read_back_exactly_what_was_written(tmp_path: Path) -> None:
    from dataclasses import replace

    from mrtr_keys.audit.writing.chain import ChainWriter
    from mrtr_keys.audit.writing.stores.base import record_row
    from tests.fixtures.audit import known_events

    url = f"sqlite://{tmp_path}/audit.db"
    odd = [
        replace(known_events(1)[0], time="2026-02-30T10:00:00.000000Z"),  # not a date: kept as text
        replace(known_events(1)[0], time="2026-07-28T10:00:00Z", fingerprint="raw:Zz"),  # other spellings
        replace(known_events(1)[0], time="1969-12-31T23:59:59.999999Z", instance=""),
        *known_events(4),
    ]
    store = open_store(url)
    try:
        store.append_rows([record_row(r) for r in ChainWriter("odd-writer#1").link(odd)])
        assert [r.event for r in store.records()] == odd
        # filters compare stored values: a time window, an instance name, a fingerprint
        assert [r.event for r in store.query(Query(since="2026-07-28T10:00:01.000000Z"))] == known_events(4)[1:]
        assert [r.event for r in store.query(Query(instance=""))] == [odd[2]]
        assert store.query(Query(instance="never-written")) == []
        assert [r.event for r in store.query(Query(fingerprint="raw:Zz"))] == [odd[1]]
        assert dict(store.stats("instance", Query()))[known_events(1)[0].instance] == 4
    finally:
        store.close()
    doc = json.loads(cli("audit", "verify", "--audit", url, "--json").out)
    assert doc["ok"] and doc["records"] == 7
    # a name changed in the names table changes every row that names it: verify sees altered batches
    from tests.fixtures.audit import sqlite_exec

    sqlite_exec(url, "UPDATE audit_names SET name = 'someone-else' WHERE name = 'odd-writer#1'")
    doc = json.loads(cli("audit", "verify", "--audit", url, "--json").out)
    assert not doc["ok"] and doc["first_break"]["kind"] == "altered"


def test_a_writer_open_across_audit_migrate_keeps_writing_and_counting(tmp_path: Path) -> None:
    from mrtr_keys.audit.writing.chain import ChainWriter
    from mrtr_keys.audit.writing.stores.base import SQL_MIGRATIONS, record_row, stored_prefix
    from tests.fixtures.audit import known_events

    path = tmp_path / "audit.db"
    conn = sqlite3.connect(path)
    with conn:  # the file as mrtr-keys wrote it before schema 4
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for version in (1, 2, 3):
            for stmt in SQL_MIGRATIONS[version]:
                conn.execute(stmt.format(autoinc="INTEGER PRIMARY KEY AUTOINCREMENT"))
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    conn.close()
    url = f"sqlite://{path}"
    store = open_store(url)  # a long-running writer: opened at schema 3
    chain = ChainWriter("writer:1:20260728T095959.000000Z#1")
    try:
        store.append_rows([record_row(r) for r in chain.link(known_events(6)[:3])])
        res = cli("audit", "migrate", "--audit", url)
        assert res.code == 0 and "from schema 3 to 5: 3 events kept" in res.out, res.err
        later = [record_row(r) for r in chain.link(known_events(6)[3:])]
        store.append_rows(later)
        assert stored_prefix(store, later) == 3  # the gray-failure count sees the migrated layout
        assert [r.event for r in store.records()] == known_events(6)
    finally:
        store.close()
    conn = sqlite3.connect(path)
    assert {type(t) for (t,) in conn.execute("SELECT time FROM audit_events")} == {int}  # all narrow
    conn.close()
    doc = json.loads(cli("audit", "verify", "--audit", url, "--json").out)
    assert doc["ok"] and doc["records"] == 6


def test_a_schema_4_store_migrates_to_5_by_replacing_one_index_and_reads_the_same(tmp_path: Path) -> None:
    """Issue 41: schema 5 keeps schema 4's narrow rows; ``audit migrate`` swaps the random-key fingerprint
    index for the bucketed one, and a writer open across it keeps writing."""
    from mrtr_keys.audit.writing.chain import ChainWriter
    from mrtr_keys.audit.writing.stores.base import record_row
    from tests.fixtures.audit import known_events, sqlite_exec

    path = tmp_path / "audit.db"
    url = f"sqlite://{path}"
    fill(url, 1_000, tx=500, keyed=False)  # (unkeyed, as the release of schema 4 wrote it)
    sqlite_exec(  # the file as schema 4 left it
        url,
        "DROP INDEX audit_events_fpb",
        "CREATE INDEX audit_events_fp4 ON audit_events (substr(fingerprint, 1, 4))",
        "DELETE FROM schema_version WHERE version = 5",
        "INSERT INTO schema_version (version) VALUES (4)",
    )
    store = open_store(url)
    chain = ChainWriter("writer:1:20260728T095959.000000Z#1")
    try:
        assert store.schema_version() == 4
        before = [r.to_json() for r in store.records()]
        fp = before[10]["fingerprint"]
        assert [r.to_json() for r in store.query(Query(fingerprint=fp))] == [
            e for e in before if e["fingerprint"] == fp
        ]
        store.append_rows([record_row(r) for r in chain.link(known_events(4)[:2])])
        res = cli("audit", "migrate", "--audit", url)
        assert res.code == 0 and "from schema 4 to 5: 1002 events kept" in res.out, res.err
        store.append_rows([record_row(r) for r in chain.link(known_events(4)[2:])])
        after = [r.to_json() for r in store.records()]
        assert after[:1_000] == before and [e["time"] for e in after[1_000:]] == [e.time for e in known_events(4)]
        assert [r.to_json() for r in store.query(Query(fingerprint=fp))] == [
            e for e in before if e["fingerprint"] == fp
        ]
    finally:
        store.close()
    where = fingerprint_clause(5).replace("?", "x'00112233'", 1).replace("?", "x'00'")
    assert "audit_events_fpb" in _plan(path, where) and "audit_events_fp4" not in _plan(path, "1")
    doc = json.loads(cli("audit", "verify", "--audit", url, "--json").out)
    assert doc["ok"] and doc["records"] == 1_004
