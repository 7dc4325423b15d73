"""A schema v1 store (as the first release created it) opens, migrates to schema 3 (the last step taken on
open) and still verifies; ``mrtr-keys audit migrate`` then takes it to schema 5 once, keeping every event
(the block of docs/audit.md, "Migrating an existing store", run as written: here with --audit)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.writing.chain import ChainWriter
from mrtr_keys.audit.writing.stores.base import AUTO_SCHEMA, SCHEMA_VERSION, SQL_COLUMNS, record_row
from mrtr_keys.audit.writing.stores.url import open_store
from tests.fixtures.audit import cli, insert, known_events

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key

# The v1 DDL exactly as mrtr-keys 1 ran it (kept literal here: the migration must cope with it).
V1_DDL = (
    """CREATE TABLE schema_version (version INTEGER NOT NULL)""",
    """CREATE TABLE audit_events (
        id {autoinc},
        time TEXT NOT NULL,
        instance TEXT NOT NULL,
        client TEXT,
        audience TEXT,
        kid TEXT,
        op TEXT NOT NULL,
        outcome TEXT NOT NULL,
        reason TEXT,
        fingerprint TEXT,
        generation BIGINT,
        duration_ms DOUBLE PRECISION,
        writer TEXT NOT NULL,
        seq BIGINT NOT NULL,
        prev_hash TEXT NOT NULL,
        hash TEXT NOT NULL
    )""",
    "CREATE INDEX audit_events_time ON audit_events (time)",
    "CREATE INDEX audit_events_kid_time ON audit_events (kid, time)",
    "CREATE INDEX audit_events_op_time ON audit_events (op, time)",
    "CREATE INDEX audit_events_fingerprint ON audit_events (fingerprint)",
    "INSERT INTO schema_version (version) VALUES (1)",
)
V2_INDEXES = {"audit_events_time", "audit_events_op_kid_time"}
V5_INDEXES = {
    "sqlite": {"audit_events_time", "audit_events_kid_op_time", "audit_events_kid", "audit_events_fpb"},
    "postgresql": {"audit_events_id", "audit_events_time", "audit_events_kid_op_time", "audit_events_fingerprint"},
}


def _v1_rows() -> list[tuple[object, ...]]:
    return [record_row(r) for r in ChainWriter("old-host:1:20260728T095959.000000Z#1").link(known_events(6))]


def _insert_sql(param: str) -> str:
    return f"INSERT INTO audit_events ({', '.join(SQL_COLUMNS)}) VALUES ({', '.join([param] * len(SQL_COLUMNS))})"


def _check_migrated(url: str, indexes: Callable[[], set[str]], make_sink: Callable[..., AuditSink]) -> None:
    store: Any = open_store(url)  # migrates
    try:
        assert store.schema_version() == AUTO_SCHEMA == 3
        assert store.instances() == []  # v3: the presence table exists, empty
        assert {i for i in indexes() if i.startswith("audit_events_")} - {"audit_events_pkey"} == V2_INDEXES
        assert [r.event for r in store.records()] == known_events(6)
    finally:
        store.close()
    res = cli("audit", "verify", "--json", "--audit", url)
    assert res.code == 0, res.err
    # new records (a new chain) land beside the old ones; both chains verify
    insert(make_sink(url), known_events(3))
    res = cli("audit", "verify", "--json", "--audit", url)
    assert res.code == 0, res.err
    report = res.json()
    assert report["ok"] is True and report["records"] == 9 and report["chains"] == 2
    # reopening a migrated store changes nothing
    again: Any = open_store(url)
    try:
        assert again.schema_version() == 3
        assert again.count() == 9
        before = [r.to_json() for r in again.records()]
    finally:
        again.close()
    # `audit migrate` takes it to schema 5 once, every event kept in its place; verify passes across it
    res = cli("audit", "migrate", "--audit", url)
    assert res.code == 0, res.err
    assert res.out.startswith("migrated ") and "from schema 3 to 5: 9 events kept" in res.out
    migrated: Any = open_store(url)
    try:
        assert migrated.schema_version() == SCHEMA_VERSION == 5
        assert [r.to_json() for r in migrated.records()] == before
        assert {i for i in indexes() if i.startswith("audit_events_")} >= V5_INDEXES[url.partition(":")[0]]
        assert "audit_events_op_kid_time" not in indexes()
    finally:
        migrated.close()
    res = cli("audit", "migrate", "--audit", url)
    assert res.code == 2 and "already at schema version 5: nothing to migrate" in res.err
    insert(make_sink(url), known_events(2))
    report = cli("audit", "verify", "--json", "--audit", url).json()
    assert report["ok"] is True and report["records"] == 11 and report["chains"] == 3


def test_sqlite_v1_store_migrates_on_open(tmp_path: Path, make_sink: Callable[..., AuditSink]) -> None:
    path = tmp_path / "audit.db"
    conn = sqlite3.connect(path)
    with conn:
        for stmt in V1_DDL:
            conn.execute(stmt.format(autoinc="INTEGER PRIMARY KEY AUTOINCREMENT"))
        conn.executemany(_insert_sql("?"), _v1_rows())
    conn.close()

    def indexes() -> set[str]:
        c = sqlite3.connect(path)
        try:
            return {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        finally:
            c.close()

    _check_migrated(f"sqlite://{path}", indexes, make_sink)


def test_postgres_v1_store_migrates_on_open(postgres_url: str, make_sink: Callable[..., AuditSink]) -> None:
    import psycopg

    with psycopg.connect(postgres_url) as conn:
        for stmt in V1_DDL:
            conn.execute(stmt.format(autoinc="BIGSERIAL PRIMARY KEY"))  # type: ignore[arg-type]
        with conn.cursor() as cur:
            cur.executemany(_insert_sql("%s"), _v1_rows())  # type: ignore[arg-type]

    def indexes() -> set[str]:
        with psycopg.connect(postgres_url) as c:
            return {r[0] for r in c.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'audit_events'")}

    _check_migrated(postgres_url, indexes, make_sink)
