"""`postgresql://...`: the audit log in PostgreSQL (psycopg 3), for fleets writing to one place.

Every instance appends its own hash chain; the schema is created and migrated on first open
under a transaction-scoped advisory lock, so instances starting together do not race. A
connection the server dropped (restart, failover, network cut) is replaced on the next call. Needs
the ``postgres`` extra (``pip install 'mrtr-keys[postgres]'``).

Deadlines (client side, issue 22; docs/audit.md): connecting `CONNECT_TIMEOUT` s; a write
transaction `WRITE_DEADLINE` s and a read `READ_DEADLINE` s, enforced by
`mrtr_keys.deadlines.WATCHDOG` (libpq has no read or write timeout: at the deadline the socket is
shut down, the call fails with "connection lost" and the next one reconnects); TCP keepalives find a
dead idle connection within about 25 s.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import date
from typing import Any

from mrtr_keys.audit.writing.stores import hours, narrow
from mrtr_keys.audit.writing.stores import pg_layout as layout
from mrtr_keys.audit.writing.stores.base import SCHEMA_VERSION, SQL_COLUMNS
from mrtr_keys.audit.writing.stores.narrow_sql import NarrowRows
from mrtr_keys.audit.writing.stores.sql import SQLStore
from mrtr_keys.deadlines import WATCHDOG, Guard
from mrtr_keys.errors import AuditError, AuditUnavailable, ConfigError, bare
from mrtr_keys.urls import redact

_COPY = f"COPY audit_events ({', '.join(SQL_COLUMNS)}) FROM STDIN"
_COPY_V5 = f"COPY audit_events ({', '.join(layout.V5_COLUMNS[1:])}) FROM STDIN"
_SELECT_V5 = (
    "SELECT id, " + ", ".join(SQL_COLUMNS) + ", time_text, fingerprint_text FROM audit_events"  # noqa: S608 - fixed names
)
PARTITIONED = 4
"""The first schema partitioned by day; 5 narrows the rows (`mrtr_keys.audit.writing.stores.pg_layout`)."""
_MIGRATION_LOCK = 0x6D72_7472_6175  # "mrtrau": the advisory lock id serialising schema migrations
_WRITER_COLUMN = SQL_COLUMNS.index("writer")
CONNECT_TIMEOUT = 2
"""Seconds to connect (libpq's ``connect_timeout``; 2 is its minimum)."""
WRITE_DEADLINE = 2.0
"""Seconds one write transaction may take, from its first statement to the commit's answer."""
READ_DEADLINE = 30.0
"""Seconds one read (a page of `records`, a query, stats) may take."""
KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}
"""libpq's TCP keepalive settings: a dead idle connection is found within about 25 s."""
CHAIN_LOCK_WAIT_MS = 2_000
"""Most milliseconds `PostgresStore.chain_length` waits for a chain's in-flight transaction to end."""
RECHECK_PARTITIONS_S = 600.0
"""Seconds a writer trusts its list of existing day partitions before reading it again."""
_TIME_COLUMN = SQL_COLUMNS.index("time")
_DROP = "drop a partition of"
log = logging.getLogger(__name__)


def chain_lock(writer: str) -> int:
    """The transaction-scoped advisory lock id of chain `writer` (a signed 64-bit hash of its name)."""
    return int.from_bytes(hashlib.blake2b(writer.encode(), digest_size=8).digest(), "big", signed=True)


class PostgresStore(NarrowRows, SQLStore):
    """The audit log in a PostgreSQL database (tables ``audit_events``, partitioned by day from schema
    4 and narrow rows from 5 (`mrtr_keys.audit.writing.stores.pg_layout`), ``audit_names``, ``instances`` and
    ``schema_version``)."""

    PARAM = "%s"
    AUTOINC = "BIGSERIAL PRIMARY KEY"
    HOUR_TEXT = 'TEXT COLLATE "C"'

    def __init__(self, url: str, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        """Unix seconds now: where `ensure_partitions` counts today from (injected by tests)."""
        self._days: set[date] = set()  # days with a partition (or skipped until the next recheck)
        self._seen: set[str] = set()  # ``YYYY-MM-DD`` prefixes of appended times already handled
        self._today = -1
        self._days_read = -RECHECK_PARTITIONS_S
        self._version_read = time.monotonic()
        try:
            import psycopg
        except ImportError:
            raise ConfigError("the postgresql audit store needs psycopg: pip install 'mrtr-keys[postgres]'") from None
        self._psycopg = psycopg
        self._dsn = url
        self._db_errors = (psycopg.Error,)
        self._init_narrow()
        super().__init__(redact(url))

    def _connect(self) -> Any:
        """A new connection; an attempt that failed closes its socket now (`mrtr_keys.errors.bare`), not at the
        next garbage collection."""
        try:
            return self._psycopg.connect(self._dsn, connect_timeout=CONNECT_TIMEOUT, **KEEPALIVES)
        except self._psycopg.Error as exc:
            message = f"cannot connect to the audit store {self.url}: {bare(exc)}"
        raise AuditUnavailable(message)

    def append_rows(self, rows: Sequence[tuple[object, ...]]) -> None:
        """Store `rows` in one transaction with ``COPY ... FROM STDIN`` (binary framing by psycopg;
        far cheaper per row than ``INSERT``)."""
        if not rows:
            return
        if self.version < PARTITIONED and time.monotonic() - self._version_read >= RECHECK_PARTITIONS_S:
            self._version_read = time.monotonic()  # migrated since this process opened the store?
            self.version = self.schema_version()
        if self.version >= PARTITIONED:
            self.ensure_partitions(str(r[_TIME_COLUMN]) for r in rows)
        counts = hours.tally(rows)
        with self._transaction("write to") as cur:
            # Held until this transaction ends, so `chain_length` cannot answer while it is in flight.
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (chain_lock(str(rows[0][_WRITER_COLUMN])),))
            stored = self._encode_rows(cur, rows)  # schema 5: narrow (names made in this transaction)
            with cur.copy(_COPY_V5 if self._narrow() else _COPY) as copy:
                write = copy.write_row
                if self._narrow():
                    for row in stored:
                        write(_v5_values(row))
                else:
                    for row in stored:
                        write(row)
            hours.add(cur, self.PARAM, counts)  # the hourly totals, in the same transaction
        self._appended()

    def chain_length(self, writer: str, since: str) -> int:
        """`AuditStore.chain_length`, after any transaction of chain `writer` still in flight has
        ended (its advisory lock, taken by `append_rows`; waited for up to `CHAIN_LOCK_WAIT_MS`): a
        commit whose answer was lost with its connection may still be running on the server, and
        the count must include it (issue 22).

        Raises:
            AuditError: the store cannot be read, or the chain's last transaction has not ended.
        """
        if self.version < SCHEMA_VERSION:  # a writer open across ``audit migrate``: count in today's layout
            self.version = self.schema_version()
        values = (self._value("time", since), self._value("writer", writer))  # before the transaction: may read
        with self._transaction("read") as cur:
            cur.execute(f"SET LOCAL lock_timeout = {CHAIN_LOCK_WAIT_MS}")
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (chain_lock(writer),))
            cur.execute("SELECT MAX(seq) FROM audit_events WHERE time >= %s AND writer = %s", values)
            row = cur.fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def _migrate(self) -> None:
        with WATCHDOG.guard(self._conn.fileno(), READ_DEADLINE):
            super()._migrate()

    def _stream(self, sql: str, args: Sequence[Any]) -> Iterator[Sequence[Any]]:
        """Rows of one read through a server-side cursor, each page of rows under `READ_DEADLINE`
        (the whole result never sits in client memory, and a long result is not cut by one deadline)."""
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
            conn = self._conn

            def names() -> dict[int, str]:  # in the cursor's transaction (a commit would close the cursor)
                return {int(i): str(n) for i, n in conn.execute("SELECT id, name FROM audit_names").fetchall()}

            try:
                with conn.cursor(name="mrtr_keys_stream") as cur:
                    with WATCHDOG.guard(conn.fileno(), READ_DEADLINE):
                        cur.execute(sql, tuple(args))
                    while True:
                        with WATCHDOG.guard(conn.fileno(), READ_DEADLINE):
                            rows = cur.fetchmany(self.STREAM_PAGE)
                        if not rows:
                            break
                        yield from self._decode(rows, names)
            except self._db_errors as exc:
                error = self._error(exc)
                if self._broken(conn):
                    self._discard()
                raise error(f"cannot read the audit store {self.url}: {exc}") from None
            finally:  # a read: end its transaction, also when the reader stopped early
                if self._conn is conn and not self._broken(conn):
                    try:
                        conn.rollback()
                    except self._db_errors:
                        pass

    def _narrow(self) -> bool:
        return self.version >= SCHEMA_VERSION

    def _upgrade(self, cur: Any, current: int) -> None:
        """Schema 3 or 4 -> 5: the new table beside the old one, every row copied with its ``id`` (in pages,
        narrowed as `narrow.Codec` does), the indexes built, the copy counted, the old table dropped."""
        cur.execute(layout.OLD_DAYS)
        days = {d for (t,) in cur.fetchall() if (d := layout.day_of(str(t)))} | layout.days_ahead(self.clock())
        old_partitions: list[str] = []
        if current >= PARTITIONED:
            cur.execute(layout.LIST_PARTITIONS)
            old_partitions = [str(name) for (name,) in cur.fetchall()]
        for stmt in layout.v5_statements(days, old_partitions):
            cur.execute(stmt)
        codec = narrow.Codec()
        select = f"SELECT id, {', '.join(SQL_COLUMNS)} FROM audit_events_old WHERE id > %s ORDER BY id LIMIT 5000"  # noqa: S608
        copy_sql = f"COPY audit_events ({', '.join(layout.V5_COLUMNS)}) FROM STDIN"
        last = 0
        while True:
            cur.execute(select, (last,))
            rows = cur.fetchall()
            if not rows:
                break
            encoded = codec.encode_rows([r[1:] for r in rows], lambda name: self._name_id(cur, name, codec.learn))
            with cur.copy(copy_sql) as copy:
                for r, e in zip(rows, encoded, strict=True):
                    copy.write_row((r[0], *_v5_values(e)))
            last = rows[-1][0]
        for stmt in layout.V5_INDEXES:
            cur.execute(stmt)
        cur.execute("SELECT COUNT(*) FROM audit_events_old")
        old = int(cur.fetchone()[0])
        cur.execute(layout.NEW_COUNT)
        if int(cur.fetchone()[0]) != old:
            raise AuditError(f"migration of {self.url}: the copy does not hold every event; rolled back")
        cur.execute(layout.DROP_OLD_V5)
        self._codec = narrow.Codec()
        self._days_read = -RECHECK_PARTITIONS_S

    def _select(self) -> str:
        return _SELECT_V5 if self._narrow() else super()._select()

    def _decode(self, rows: list[Any], names: Callable[[], dict[int, str]] | None = None) -> list[Any]:
        """Schema 5: a value kept as text (``time_text``, ``fingerprint_text``) in place of its NULL narrow
        column, then the narrow values as written (`names` reads ``audit_names`` again on an unknown id)."""
        if not self._narrow():
            return rows
        return self._codec.decode_rows(merged_rows(rows), names or self._names)

    def run_pages(self, after: int = 0, size: int = 20_000) -> tuple[narrow.Pieces, Iterator[list[narrow.Run]]] | None:
        """`row_batches` for ``verify``'s hot loop, as the SQLite store's (`narrow.Pieces.runs` over the narrow
        rows, `merged_rows`); None before schema 5 (use `row_batches`)."""
        if not self._narrow():
            return None
        view = self.piece_view()
        sql = _SELECT_V5 + " WHERE id > %s ORDER BY id LIMIT " + str(int(size))

        def pages(last: int) -> Iterator[list[narrow.Run]]:
            while rows := self._fetch(sql, [last]):
                last = int(rows[-1][0])
                yield view.runs(merged_rows(rows))
                del rows

        return view, pages(after)

    def piece_view(self) -> narrow.Pieces:
        """A `narrow.Pieces` over this store (schema 5)."""
        sql = _SELECT_V5 + " WHERE id >= %s AND id <= %s ORDER BY id"
        return narrow.Pieces(self._codec, self._names, lambda lo, hi: self._decode(self._fetch(sql, [lo, hi])))

    def position_span(self, after: int) -> tuple[int, int]:
        """(lowest position after `after`, minus 1; highest position), or (after, after) if none."""
        low, high = self._fetch("SELECT MIN(id), MAX(id) FROM audit_events WHERE id > %s", [after])[0]
        return (after, after) if low is None else (int(low) - 1, int(high))

    def reader(self) -> tuple[Callable[[], Any], str]:
        """(connect, select of a range ``lo < id <= hi``) for a reading child of ``verify`` (a fork of this
        process: the connection string never leaves its memory; `mrtr_keys.audit.verifying.verify_parallel`)."""
        dsn, psycopg = self._dsn, self._psycopg
        return (
            lambda: psycopg.connect(dsn, connect_timeout=CONNECT_TIMEOUT, **KEEPALIVES),
            _SELECT_V5 + " WHERE id > %s AND id <= %s ORDER BY id",
        )

    def _value(self, column: str, value: Any) -> Any:
        stored = super()._value(column, value)
        if column == "time" and self._narrow() and not isinstance(stored, int):
            return None  # a time not in the canonical form: compared with none (such rows have NULL)
        return stored

    def _fingerprint_clause(self, value: Any) -> tuple[str, list[Any]]:
        if self._narrow() and isinstance(value, str):
            return "fingerprint_text = %s", [value]
        return super()._fingerprint_clause(value)

    def _time_window(self, since: str | None, until: str | None) -> tuple[str, list[Any]]:
        """Schema 5: canonical bounds compare microseconds; a bound that is not canonical compares the
        texts of the rows kept as text (`pg_layout`), as schema 4 compared every row."""
        if not self._narrow():
            return super()._time_window(since, until)
        low, high = self._codec.encode_time(since), self._codec.encode_time(until)
        if isinstance(low, int | None) and isinstance(high, int | None):
            parts = [c for c, v in (("time >= %s", low), ("time < %s", high)) if v is not None]
            return " AND ".join(parts), [v for v in (low, high) if v is not None]
        parts = [c for c, v in (("time_text >= %s", since), ("time_text < %s", until)) if v is not None]
        return " AND ".join(parts), [v for v in (since, until) if v is not None]

    def partition_days(self) -> list[date]:
        """The days that have a partition (schemas 4 and 5), oldest first."""
        if self.version < PARTITIONED:
            return []
        rows = self._fetch(layout.LIST_PARTITIONS, [])
        return sorted(d for (name,) in rows if (d := layout.day_of_partition(name)))

    def ensure_partitions(self, times: Iterable[str] = (), *, now: float | None = None) -> list[date]:
        """Create the day partitions missing for today and `layout.AHEAD_DAYS` after it (at `now`,
        default `clock()`) and for the days of `times` (event time strings); returns the days
        created. A day whose partition cannot be created (a long reader holds the table past
        `layout.PARTITION_LOCK_TIMEOUT_MS`, or the default partition holds rows of that day) is
        skipped: its rows go to ``audit_events_default``, and it is tried again after
        `RECHECK_PARTITIONS_S`. Cheap when nothing is missing (the writer calls it every append).

        Raises:
            AuditError: the store cannot be reached.
        """
        prefixes = {t[:10] for t in times} - self._seen
        today = int((self.clock() if now is None else now) // 86_400)
        if not prefixes and today == self._today and time.monotonic() - self._days_read < RECHECK_PARTITIONS_S:
            return []
        days = {d for p in prefixes if (d := layout.day_of(p))} | layout.days_ahead(today * 86_400.0)
        if time.monotonic() - self._days_read >= RECHECK_PARTITIONS_S or not days <= self._days:
            self._days = set(self.partition_days())
            self._days_read = time.monotonic()
        created = []
        for day in sorted(days - self._days):
            try:
                with self._transaction("write to") as cur:
                    cur.execute(f"SET LOCAL lock_timeout = {layout.PARTITION_LOCK_TIMEOUT_MS}")
                    cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
                    cur.execute((layout.create_partition_v5 if self._narrow() else layout.create_partition)(day))
                created.append(day)
            except AuditError as exc:
                if self._conn is None:
                    raise  # the connection is gone: the append fails and is retried
                log.warning("audit store %s: no partition for %s yet (%s)", self.url, day, exc)
            self._days.add(day)  # created, or skipped until the next recheck
        self._seen |= prefixes
        self._today = today
        return created

    def drop_partitions(self, before: str, limits: dict[str, int]) -> int:
        """Drop every day partition that ends at or before `before` (an event time string) and whose
        records are all at or before their chain's prune cut (`limits`: writer -> last cut seq);
        returns how many records went (`mrtr_keys.audit.retention.prune`). Each partition is checked and
        dropped in one transaction with inserts into it blocked, so a late row is never lost
        unchecked. Records before the cut in partitions that stay are deleted by the caller.

        Raises:
            AuditError: the store cannot be read or written.
        """
        end = layout.day_of(before)
        if self.version < PARTITIONED or end is None:
            return 0
        writer = "(SELECT name FROM audit_names WHERE audit_names.id = writer)" if self._narrow() else "writer"
        dropped = 0
        for day in self.partition_days():
            if day >= end:  # not entirely before the cut (ranges end at the next midnight)
                break
            name = layout.partition_name(day)
            try:
                with self._transaction(_DROP) as cur:
                    cur.execute(f"SET LOCAL lock_timeout = {layout.PARTITION_LOCK_TIMEOUT_MS}")
                    cur.execute(f"LOCK TABLE {name} IN SHARE MODE")
                    cur.execute(f"SELECT {writer}, MAX(seq), COUNT(*) FROM {name} GROUP BY writer")  # noqa: S608
                    chains = cur.fetchall()
                    if any(limits.get(w, 0) < int(top) for w, top, _ in chains):
                        continue  # holds records after a cut: they go page by page
                    cur.execute(f"DROP TABLE {name}")
            except AuditError as exc:
                if self._conn is None:
                    raise
                log.warning("audit store %s: partition %s not dropped (%s); pruned page by page", self.url, name, exc)
                continue
            dropped += sum(int(n) for _, _, n in chains)
            self._days.discard(day)
        return dropped

    def _odd_clause(self) -> str:
        return "time IS NULL" if self._narrow() else "time !~ '^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:'"

    def _hour_window(self, hour: str) -> tuple[str, list[Any]]:
        start = self._codec.encode_time(hour + ":00:00.000000Z") if self._narrow() else None
        if not isinstance(start, int):
            return super()._hour_window(hour)
        return "time >= %s AND time < %s", [start, start + 3_600_000_000]

    def _lock_hours(self, cur: Any) -> None:
        # Conflicts with the ROW EXCLUSIVE lock of a writer's upsert: a writer whose events this
        # recount cannot see yet adds its counts after it, one that committed is seen by it.
        cur.execute("LOCK TABLE audit_hours IN SHARE ROW EXCLUSIVE MODE")

    def _deadline(self, verb: str) -> Guard:
        long = verb in ("read", _DROP, hours.RECOUNT)  # a read, or one day partition scanned and dropped
        return WATCHDOG.guard(self._conn.fileno(), READ_DEADLINE if long else WRITE_DEADLINE)

    def _error(self, exc: BaseException) -> type[AuditError]:
        """An outage: the connection is gone, or the server refused, cut or timed out the call
        (``OperationalError``: connection failures, ``lock_timeout``, the watchdog's deadline)."""
        conn = self._conn
        lost = conn is not None and self._broken(conn)
        return AuditUnavailable if lost or isinstance(exc, self._psycopg.OperationalError) else AuditError

    def _broken(self, conn: Any) -> bool:
        return bool(conn.closed or conn.broken)

    def _lock_schema(self, cur: Any) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))

    def _lock_events(self, cur: Any) -> None:
        """ACCESS EXCLUSIVE at once (the rename in `_upgrade` takes it anyway; taken later, after a read, it
        could deadlock with a transaction that reads and then writes, as a prune does)."""
        cur.execute("LOCK TABLE audit_events IN ACCESS EXCLUSIVE MODE")


def merged_rows(rows: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """Raw schema 5 rows (``id``, `SQL_COLUMNS`, ``time_text``, ``fingerprint_text``) as narrow rows (``id``, then
    `SQL_COLUMNS` as `narrow.Codec` encodes them): a value kept as text in place of its NULL narrow column."""
    return [
        (*r[:1], r[16] if r[1] is None else r[1], *r[2:9], r[17] if r[9] is None else r[9], *r[10:16]) for r in rows
    ]


def _v5_values(row: Sequence[Any]) -> tuple[Any, ...]:
    """A narrow row (`narrow.Codec.encode_rows`, `SQL_COLUMNS` order) as schema 5's columns after ``id``
    (`pg_layout.V5_COLUMNS`): a time or fingerprint left as text goes to its ``*_text`` column."""
    t, inst, client, aud, kid, op, outcome, reason, fp, gen, dur, w, seq, prev, h = row
    odd_time = t if t.__class__ is str else None
    odd_fp = fp if fp.__class__ is str else None
    return (
        None if odd_time is not None else t,
        seq,
        gen,
        dur,
        inst,
        w,
        client,
        aud,
        kid,
        op,
        outcome,
        reason,
        None if odd_fp is not None else fp,
        prev,
        h,
        odd_time,
        odd_fp,
    )
