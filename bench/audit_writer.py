"""Audit writer throughput: events/s through the writer process vs the store's own limit.

Subject: a process-mode `AuditSink` over a fresh store; 100,000 items (seal and unseal of real
tokens, the shape a sidecar queues) are queued, then `flush()` waits until the writer process has
fingerprinted, chained and committed every one. Anchor: the same rows, already built (fingerprints
included), written by a bare loop with no hashing: ``executemany`` of one ``INSERT`` into SQLite
(transactions as large as the writer's), ``COPY ... FROM STDIN`` into PostgreSQL (same transactions), into a
fresh table of the same schema. Wall time, interleaved rounds; the ratio is subject/anchor rate.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import Settings, envelope_payload
from bench.report import Row, spread_of
from bench.timing import median, paired_ratio

PART = "audit"
PG_ADMIN = os.environ.get("MRTR_KEYS_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
TX = 2_000
"""Rows per transaction of the bare loops: the writer's own `MAX_TX_EVENTS`."""


def _items(n: int, directory: Path) -> list[Any]:
    from mrtr_keys.audit.capture.items import AuditItem
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.codecs.local import LocalAESGCMCodec
    from mrtr_keys.keystores.file import FileKeystore

    ring = directory / "writer-ring" / "keyring.json"
    create_ring(FileKeystore(ring))
    codec = LocalAESGCMCodec(ring, audience="bench")
    payload = envelope_payload()
    now = time.time()
    out: list[Any] = []
    for i in range(n // 2):
        token = codec.seal(payload)
        out.append(AuditItem("seal", "ok", "abcd1234", token, None, now + i * 1e-5, "bench", 1, "web", 0.05))
        out.append(AuditItem("unseal", "ok", "abcd1234", token, None, now + i * 1e-5, "bench", 1, "web", 0.07))
    return out


def _writer_rate(url: str, items: list[Any]) -> float:
    from mrtr_keys.audit.capture.sink import AuditSink
    from mrtr_keys.audit.writing.fingerprint import Fingerprinter
    from mrtr_keys.audit.writing.stores.url import open_store

    sink = AuditSink(
        open_store(url),
        Fingerprinter(os.urandom(32)),
        mode="process",
        url=url,
        capacity=4 * len(items),
        max_bytes=1 << 31,
    )
    try:
        sink.submit(items[0])
        assert sink.flush(60)  # the writer process is started and connected before the clock runs
        submit = sink.submit
        started = time.perf_counter()
        for item in items:
            submit(item)
        assert sink.flush(600), sink.last_error
        elapsed = time.perf_counter() - started
        assert sink.dropped == 0
        return len(items) / elapsed
    finally:
        sink.close()


def _rows(items: list[Any]) -> list[tuple[object, ...]]:
    from mrtr_keys.audit.capture.items import item_rows
    from mrtr_keys.audit.writing.fingerprint import Fingerprinter

    return item_rows(items, "host:1:20260101T000000.000000Z", Fingerprinter(os.urandom(32)), {}, "w", 1)


def _as_stored(url: str, rows: list[tuple[object, ...]]) -> tuple[list[str], list[tuple[object, ...]]]:
    """A new store at `url` (the same schema, indexes and pragmas as the writer's) and `rows` as its
    ``append_rows`` would store them (the narrow values of schema 5, names made): (columns, rows)."""
    from mrtr_keys.audit.writing.stores import pg_layout
    from mrtr_keys.audit.writing.stores.base import SQL_COLUMNS
    from mrtr_keys.audit.writing.stores.postgres import _v5_values
    from mrtr_keys.audit.writing.stores.url import open_store

    store: Any = open_store(url)
    try:
        with store._transaction("write to") as cur:
            store._begin(cur)
            stored = list(store._encode_rows(cur, rows))
        store._appended()
        if url.startswith("postgresql") and store._narrow():
            return list(pg_layout.V5_COLUMNS[1:]), [_v5_values(r) for r in stored]
        return list(SQL_COLUMNS), stored
    finally:
        store.close()


def _bare_sqlite(url: str, rows: list[tuple[object, ...]]) -> float:
    import sqlite3

    columns, rows = _as_stored(url, rows)
    conn = sqlite3.connect(url.removeprefix("sqlite://"), isolation_level=None)
    conn.execute("PRAGMA synchronous = NORMAL")
    sql = f"INSERT INTO audit_events ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
    started = time.perf_counter()
    for start in range(0, len(rows), TX):
        conn.execute("BEGIN")
        conn.executemany(sql, rows[start : start + TX])
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return len(rows) / elapsed


def _bare_copy(url: str, rows: list[tuple[object, ...]]) -> float:
    import psycopg

    columns, rows = _as_stored(url, rows)
    copy_sql = f"COPY audit_events ({', '.join(columns)}) FROM STDIN"
    with psycopg.connect(url) as conn:
        started = time.perf_counter()
        for start in range(0, len(rows), TX):
            with conn.cursor() as cur, cur.copy(copy_sql) as copy:
                for row in rows[start : start + TX]:
                    copy.write_row(row)
            conn.commit()
        elapsed = time.perf_counter() - started
    return len(rows) / elapsed


def _pg_database() -> tuple[str, Callable[[], None]] | None:
    try:
        import psycopg
    except ImportError:
        return None
    name = f"mrtr_bench_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.Error:
        return None

    def drop() -> None:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return PG_ADMIN.rsplit("/", 1)[0] + "/" + name, drop


def _reset_pg(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP SCHEMA public CASCADE")  # every audit table, whatever the schema version holds
        conn.execute("CREATE SCHEMA public")


def run(directory: Path, settings: Settings) -> list[Row]:
    n = 5_000 if settings.quick else 100_000
    rounds = 1 if settings.quick else 3
    items = _items(n, directory)
    rows = _rows(items)
    out: list[Row] = []
    sub: list[float] = []
    anc: list[float] = []
    for r in range(rounds):
        sub.append(_writer_rate(f"sqlite://{directory}/writer-{r}.db", items))
        anc.append(_bare_sqlite(f"sqlite://{directory}/bare-{r}.db", rows))
    out += _pair("SQLite", "bare executemany", sub, anc, n, ">= 150000", min_ratio=">= 0.5x")
    pg = _pg_database()
    if pg is None:
        out.append(Row.missing(PART, "audit writer, PostgreSQL", "n/a: PostgreSQL not reachable", target=">= 0.5x"))
        return out
    url, drop = pg
    try:
        sub, anc = [], []
        for _ in range(rounds):
            _reset_pg(url)
            sub.append(_writer_rate(url, items))
            _reset_pg(url)
            anc.append(_bare_copy(url, rows))
        out += _pair("PostgreSQL", "bare COPY", sub, anc, n, None, min_ratio=">= 0.5x")
    finally:
        drop()
    return out


def _pair(
    store: str, bare: str, sub: list[float], anc: list[float], n: int, floor: str | None, *, min_ratio: str
) -> list[Row]:
    base = Row(PART, f"{bare} of the same rows, {store}", "ev/s", median(anc), spread_of(anc))
    base.samples = anc
    base.note = f"{n:,} rows already built (fingerprints, narrow values), transactions of {TX:,}, no hashing"
    row = Row(PART, f"audit writer, {store}", "ev/s", median(sub), spread_of(sub), base.name)
    row.samples = sub
    row.ratio = paired_ratio(sub, anc)
    row.note = f"{n:,} events queued then flush(): fingerprint, batch chain, store; 0 dropped"
    row.decide(row.ratio, min_ratio)
    if floor is not None and row.status == "PASS" and median(sub) < float(floor.split()[1]):
        row.status = "MISS"
        row.note += f"; below the absolute target {floor} ev/s"
    row.target = min_ratio + (f" and {floor} ev/s" if floor else "")
    return [base, row]
