"""PostgreSQL schemas 4 and 5: ``audit_events`` partitioned by day (issue 26, item 4; issue 41).

Partitions are made ahead of time and by the writer when a day rolls over (an injected clock and
event times, no sleeping); the gray-failure append check (`stored_prefix`) still counts exactly
across partitions; ``audit prune`` drops whole partitions; ``audit migrate`` converts a schema 3 or 4
store to 5 keeping every event, and ``audit verify`` passes across it. Logs are genuine
(`bench.audit_log.fill`: the writer's own rows and chain).
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

import psycopg
import pytest
from bench.audit_log import fill

from mrtr_keys.audit.events import AuditEvent
from mrtr_keys.audit.writing.chain import ChainWriter
from mrtr_keys.audit.writing.stores import pg_layout as layout
from mrtr_keys.audit.writing.stores.base import SQL_COLUMNS, SQL_MIGRATIONS, record_row, stored_prefix
from mrtr_keys.audit.writing.stores.pg_layout import AHEAD_DAYS, day_of
from mrtr_keys.audit.writing.stores.postgres import PostgresStore
from tests.fixtures.audit import cli, known_events
from tests.support.waiting import until

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key

DAY = 86_400.0
T0 = 1_930_050_000.0  # 2031-02-28T12:53:20Z


def _rows_of(url: str, table: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
        assert row is not None
        return int(row[0])


def _days(*isos: str) -> list[date]:
    return [date.fromisoformat(d) for d in isos]


def test_a_new_store_has_partitions_ahead_and_the_writer_adds_one_when_a_day_rolls_over(postgres_url: str) -> None:
    now = [T0]
    store = PostgresStore(postgres_url, clock=lambda: now[0])
    try:
        assert store.version == 5
        assert store.partition_days() == _days("2031-02-28", "2031-03-01", "2031-03-02")  # today + AHEAD_DAYS
        assert AHEAD_DAYS == 2
        # an append whose events fall on a day with no partition yet (late-night batch crossing midnight,
        # or a back-dated event) creates it inside the append; the batch stays one transaction
        chain = ChainWriter("w:1:20310228T000000.000000Z#1")
        times = ["2031-03-02T23:59:59.999999Z", "2031-03-03T00:00:00.000000Z", "2031-02-20T08:00:00.000000Z"]
        events = [replace(e, time=t) for e, t in zip(known_events(3), times, strict=True)]
        rows = [record_row(r) for r in chain.link(events)]
        store.append_rows(rows)
        assert store.partition_days() == _days("2031-02-20", "2031-02-28", "2031-03-01", "2031-03-02", "2031-03-03")
        assert _rows_of(postgres_url, "audit_events_p20310303") == 1
        assert _rows_of(postgres_url, "audit_events_p20310220") == 1
        assert _rows_of(postgres_url, "audit_events_default") == 0
        # the gray-failure check (a re-send after a lost commit answer) still sees exactly what landed
        assert stored_prefix(store, rows) == 3
        # the clock moves on three days: the next append makes the new days ahead, no sleeping
        now[0] += 3 * DAY
        store.append_rows([record_row(r) for r in chain.link(known_events(1))])
        assert store.partition_days()[-3:] == _days("2031-03-03", "2031-03-04", "2031-03-05")
        # a time that is not ISO 8601 still lands (the default partition) and is read back unchanged
        odd = [record_row(r) for r in chain.link([AuditEvent(time="not-a-time", instance="x", op="seal")])]
        store.append_rows(odd)
        assert _rows_of(postgres_url, "audit_events_default") == 1
        assert [r.event.time for r in store.records()][-1] == "not-a-time"
    finally:
        store.close()
    doc = json.loads(cli("audit", "verify", "--audit", postgres_url, "--json").out)
    assert doc["ok"] and doc["records"] == 5


def test_prune_drops_whole_partitions_before_the_cut(postgres_url: str, tmp_path: Path) -> None:
    cps = tmp_path / "checkpoints.jsonl"
    fill(postgres_url, 6_000, tx=500, span=40 * DAY)
    store: Any = PostgresStore(postgres_url)
    try:
        before = store.partition_days()
    finally:
        store.close()
    res = cli("audit", "prune", "--before", "30d", "--audit", postgres_url, "--checkpoints", str(cps), "--json")
    assert res.code == 0, res.err
    deleted = json.loads(res.out)["deleted"]
    store = PostgresStore(postgres_url)
    try:
        after = store.partition_days()
        cutoff = json.loads(res.out)["before"]
        gone = [d for d in before if d not in after]
        # the days wholly before the cut-off went as whole partitions (those holding nothing after a
        # chain's cut: all of them here but the last, whose batch straddles); none at or after it
        assert gone == before[: len(gone)] and len(gone) >= 8
        assert all(d.isoformat() < cutoff[:10] for d in gone) and after[0].isoformat() <= cutoff[:10]
        assert store.count() == 6_000 - deleted
    finally:
        store.close()
    doc = json.loads(cli("audit", "verify", "--audit", postgres_url, "--checkpoints", str(cps), "--json").out)
    assert doc["ok"] and doc["pruned_before"] and doc["records"] == 6_000 - deleted


def _schema_3_store(url: str) -> None:
    """The store as mrtr-keys created it before schema 4 (migrations 1 to 3, one table)."""
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for version in (1, 2, 3):
            for stmt in SQL_MIGRATIONS[version]:
                conn.execute(stmt.format(autoinc="BIGSERIAL PRIMARY KEY"))  # type: ignore[arg-type]
            conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (version,))


def _to_schema_4(url: str) -> None:
    """A schema 3 store converted as `audit migrate` did before schema 5 (day partitions on the event time text)."""
    with psycopg.connect(url) as conn:
        days = {d for (t,) in conn.execute("SELECT DISTINCT left(time, 10) FROM audit_events") if (d := day_of(t))}
        for stmt in (
            "ALTER TABLE audit_events RENAME TO audit_events_v3",
            "ALTER TABLE audit_events_v3 RENAME CONSTRAINT audit_events_pkey TO audit_events_v3_pkey",
            "DROP INDEX audit_events_time",
            "DROP INDEX audit_events_op_kid_time",
            "ALTER SEQUENCE audit_events_id_seq OWNED BY NONE",
            f"CREATE TABLE audit_events ({layout.COLUMNS_DDL}) PARTITION BY RANGE (time)",
            "ALTER SEQUENCE audit_events_id_seq OWNED BY audit_events.id",
            f"CREATE TABLE {layout.DEFAULT_PARTITION} PARTITION OF audit_events DEFAULT",
            *(layout.create_partition(d) for d in sorted(days)),
            "INSERT INTO audit_events SELECT * FROM audit_events_v3",
            *layout.INDEXES,
            "DROP TABLE audit_events_v3",
            "INSERT INTO schema_version (version) VALUES (4)",
        ):
            conn.execute(stmt)  # type: ignore[arg-type]


@pytest.mark.parametrize("start", [3, 4])
def test_migrate_narrows_a_schema_3_or_4_store_keeping_events(postgres_url: str, tmp_path: Path, start: int) -> None:
    cps = tmp_path / "checkpoints.jsonl"
    _schema_3_store(postgres_url)
    fill(postgres_url, 4_000, tx=500, span=20 * DAY)  # written in the old layout (opened at schema 3)
    if start == 4:
        _to_schema_4(postgres_url)
    assert cli("audit", "checkpoint", "--audit", postgres_url, "--checkpoints", str(cps)).code == 0
    store = PostgresStore(postgres_url)
    try:
        assert store.version == start
        old = [(r.position, r.writer, r.seq, r.prev_hash, r.hash, r.event) for r in store.records()]
    finally:
        store.close()
    res = cli("audit", "migrate", "--audit", postgres_url, "--json")
    assert res.code == 0, res.err
    assert json.loads(res.out) | {"seconds": 0} == {
        "store": postgres_url,
        "store_id": json.loads(cps.read_text())["store_id"],  # given on the first open; migrate keeps it
        "from": start,
        "to": 5,
        "events": 4_000,
        "counted": 0,  # the hourly totals of `audit stats` were kept by the writers from the start
        "seconds": 0,
    }
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT relkind FROM pg_class WHERE relname = 'audit_events'").fetchone() == ("p",)
        assert conn.execute("SELECT to_regclass('audit_events_old')").fetchone() == (None,)
        assert conn.execute("SELECT pg_typeof(time)::text FROM audit_events LIMIT 1").fetchone() == ("bigint",)
    store = PostgresStore(postgres_url)
    try:  # every event read back as written, at the same storage position
        assert [(r.position, r.writer, r.seq, r.prev_hash, r.hash, r.event) for r in store.records()] == old
        assert len(store.partition_days()) >= 21 and _rows_of(postgres_url, "audit_events_default") == 0
    finally:
        store.close()
    # the sequence carried over: new events follow the old ones; verify passes across the migration
    fill(postgres_url, 1_000, tx=500, host="after-migrate", span=DAY)
    doc = json.loads(cli("audit", "verify", "--audit", postgres_url, "--checkpoints", str(cps), "--json").out)
    assert doc["ok"] and doc["records"] == 5_000 and doc["chains"] == 5 and doc["checkpoints_checked"] == 3
    # audit query streams through a server-side cursor: every seal, in storage order, across partitions
    seals = json.loads(cli("audit", "query", "--audit", postgres_url, "--op", "seal", "--json").out)
    by_time = [e for _, _, _, _, _, e in old if e.op == "seal"]
    assert len(seals) == 2_500 and [e["time"] for e in seals[:2_000]] == [e.time for e in by_time]
    again = cli("audit", "migrate", "--audit", postgres_url)
    assert again.code != 0 and again.err.count("\n") == 1 and "already at schema version 5" in again.err


def test_migrate_waits_for_a_writer_in_flight_and_keeps_its_events(postgres_url: str) -> None:
    """A writer's transaction still open when ``audit migrate`` starts: the migrate waits for it and keeps its
    rows too. It counted the events before it locked the table, so the rows that writer committed while the
    migrate waited to rename the table made the copy "keep 1010 of 1000 events" and roll back (seen on a
    500 k-event store with one writer appending every 0.1 s: 39 s of copying, then nothing migrated)."""
    _schema_3_store(postgres_url)
    fill(postgres_url, 1_000, tx=500, span=2 * DAY)
    _to_schema_4(postgres_url)
    columns = ", ".join(SQL_COLUMNS)
    writer = psycopg.connect(postgres_url)  # a transaction of 10 rows, not committed yet
    writer.execute(f"INSERT INTO audit_events ({columns}) SELECT {columns} FROM audit_events ORDER BY id LIMIT 10")  # type: ignore[arg-type]
    result: list[Any] = []
    migrating = threading.Thread(target=lambda: result.append(cli("audit", "migrate", "--audit", postgres_url)))
    migrating.start()
    try:
        with psycopg.connect(postgres_url, autocommit=True) as watch:
            waiting = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            until(lambda: watch.execute(waiting).fetchone() == (1,), 30, "the migrate waiting for the writer")  # type: ignore[arg-type]
        writer.commit()
    finally:
        writer.close()
        migrating.join(120)
    (res,) = result
    assert (res.code, res.err) == (0, "")
    assert "from schema 4 to 5: 1010 events kept" in res.out
    assert _rows_of(postgres_url, "audit_events") == 1_010
