"""What the SQLite and PostgreSQL stores share: the schema migrations, inserts and queries."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from itertools import chain
from typing import Any

from mrtr_keys.audit.events import STATS_KEYS, AuditEvent
from mrtr_keys.audit.writing.chain import Record
from mrtr_keys.audit.writing.stores import hours
from mrtr_keys.audit.writing.stores.base import (
    INSTANCE_COLUMNS,
    SQL_COLUMNS,
    Query,
)
from mrtr_keys.audit.writing.stores.hours import HourTotals
from mrtr_keys.audit.writing.stores.key_usage import SQLKeyUsage
from mrtr_keys.audit.writing.stores.sql_schema import SchemaSteps
from mrtr_keys.deadlines import Guard
from mrtr_keys.errors import AuditError, ConfigError

_SELECT = "SELECT id, " + ", ".join(SQL_COLUMNS) + " FROM audit_events"  # noqa: S608 - fixed column names


def _row_to_record(row: Sequence[Any]) -> Record:
    (pos, time, instance, client, audience, kid, op, outcome, reason, fp, gen, dur, writer, seq, prev, h) = row
    ev = AuditEvent(
        time=time,
        instance=instance,
        op=op,
        outcome=outcome,
        client=client,
        audience=audience,
        kid=kid,
        reason=reason,
        fingerprint=fp,
        generation=None if gen is None else int(gen),
        duration_ms=None if dur is None else float(dur),
    )
    return Record(ev, writer, int(seq), prev, h, int(pos))


class SQLStore(HourTotals, SQLKeyUsage, SchemaSteps):
    """Base of the SQL stores; a subclass supplies `_connect`, `_db_errors`, `PARAM`, `AUTOINC`, `_lock_schema`.

    A connection the server dropped (`_broken`) is discarded on the error that revealed it, and the
    next call opens a new one, so a store outage is survived without a restart; callers retry with
    backoff (the writer process, `mrtr_keys.audit.writing.direct.DirectWriter.recover`).
    """

    PARAM = "?"
    AUTOINC = "INTEGER PRIMARY KEY AUTOINCREMENT"
    _db_errors: tuple[type[BaseException], ...] = ()
    version = 0
    """The schema version of the open store (`SCHEMA_VERSION`, or `AUTO_SCHEMA` until migrated)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._lock = threading.RLock()
        self._insert_cache: dict[int, str] = {}
        self._conn: Any = self._connect()
        try:
            self._migrate()
        except self._db_errors as exc:
            self.close()
            raise self._error(exc)(f"cannot set up the audit schema in {self.url}: {exc}") from None

    @property
    def url(self) -> str:
        return self._url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _connect(self) -> Any:
        raise NotImplementedError

    def _begin(self, cur: Any) -> None:
        """Start a write transaction (psycopg starts one implicitly)."""

    def schema_version(self) -> int:
        row = self._fetch("SELECT MAX(version) FROM schema_version", [])[0]
        return int(row[0]) if row and row[0] is not None else 0

    ROWS_PER_INSERT = 500
    """Rows per multi-row ``INSERT ... VALUES (...), (...)`` statement (7 500 bound values; one
    statement per chunk costs less than one execution per row)."""

    def _insert_sql(self, n: int) -> str:
        sql = self._insert_cache.get(n)
        if sql is None:
            row = "(" + ", ".join([self.PARAM] * len(SQL_COLUMNS)) + ")"
            sql = f"INSERT INTO audit_events ({', '.join(SQL_COLUMNS)}) VALUES " + ", ".join([row] * n)  # noqa: S608 - fixed names, bound values
            if len(self._insert_cache) < 8:
                self._insert_cache[n] = sql
        return sql

    def append_rows(self, rows: Sequence[tuple[object, ...]]) -> None:
        if not rows:
            return
        step = self.ROWS_PER_INSERT
        counts = hours.tally(rows)
        with self._transaction("write to") as cur:
            self._begin(cur)
            rows = self._encode_rows(cur, rows)
            full = len(rows) - len(rows) % step
            for start in range(0, full, step):  # always `step` rows: one prepared statement
                cur.execute(self._insert_sql(step), list(chain.from_iterable(rows[start : start + step])))
            if full < len(rows):
                # The rest row by row with one single-row statement: a multi-row INSERT per remainder
                # size would fill the driver's statement cache with up to 128 large prepared
                # statements (tens of MB in a long-running writer).
                cur.executemany(self._insert_sql(1), rows[full:])
            hours.add(cur, self.PARAM, counts)  # the hourly totals, in the same transaction
        self._appended()

    # Hooks of a dialect whose stored values differ from the event's (narrow rows: `narrow_sql`).
    def _encode_rows(self, cur: Any, rows: Sequence[tuple[object, ...]]) -> Sequence[tuple[object, ...]]:
        """`rows` as stored (inside the append transaction)."""
        return rows

    def _appended(self) -> None:
        """After an append committed."""

    def _select(self) -> str:
        """``SELECT`` of the raw rows `_decode` turns into ``id`` then `SQL_COLUMNS` (``FROM audit_events``)."""
        return _SELECT

    def _decode(self, rows: list[Any]) -> list[Any]:
        """Raw rows (position, then stored values) as the values written."""
        return rows

    def _time_window(self, since: str | None, until: str | None) -> tuple[str, list[Any]]:
        """The clause (and its values) of ``since <= time < until`` (either may be None)."""
        parts = [c for c, v in (("time >= " + self.PARAM, since), ("time < " + self.PARAM, until)) if v is not None]
        return " AND ".join(parts), [v for v in (since, until) if v is not None]

    def _value(self, column: str, value: Any) -> Any:
        """A value to compare with `column` as stored."""
        return value

    def _fingerprint_clause(self, value: Any) -> tuple[str, list[Any]]:
        """The clause (and its values) finding the rows of fingerprint `value` (as stored) through the
        dialect's index."""
        return f"fingerprint = {self.PARAM}", [value]

    @contextmanager
    def _transaction(self, verb: str) -> Iterator[Any]:
        """A cursor inside one transaction under the store lock: committed on success, rolled back
        and turned into `AuditError` ("cannot {verb} the audit store ...") on a database error."""
        with self._lock:
            if self._conn is None:  # lost with the last error: reconnect (raises AuditError)
                self._conn = self._connect()
            guard = self._deadline(verb)
            try:
                with guard or nullcontext():
                    yield self._conn.cursor()
                    self._conn.commit()
            except self._db_errors as exc:
                try:
                    self._conn.rollback()
                except self._db_errors:
                    pass
                error = self._error(exc)
                if self._broken(self._conn):
                    self._discard()
                why = f"not done within its {guard.seconds:g} s deadline ({exc})" if guard and guard.fired else exc
                raise error(f"cannot {verb} the audit store {self.url}: {why}") from None

    def _deadline(self, verb: str) -> Guard | None:
        """The client-side bound of one transaction (a network store; see `PostgresStore`), or None."""
        return None

    def _error(self, exc: BaseException) -> type[AuditError]:
        """`AuditUnavailable` if `exc` (a database error) means the store cannot be reached now (a
        lost or refused connection, a held lock, an I/O error), else `AuditError`."""
        return AuditError

    def _broken(self, conn: Any) -> bool:
        """True if `conn` cannot be used again (the server went away): the next call reconnects."""
        return False

    def _discard(self) -> None:
        conn, self._conn = self._conn, None
        try:
            conn.close()
        except self._db_errors:
            pass

    def _where(self, q: Query) -> tuple[str, list[Any]]:
        p = self.PARAM
        clauses: list[str] = []
        args: list[Any] = []
        if q.after_position:
            clauses.append(f"id > {p}")
            args.append(q.after_position)
        if q.since is not None or q.until is not None:
            clause, values = self._time_window(q.since, q.until)
            clauses.append(clause)
            args.extend(values)
        for name, value in q.filters().items():
            value = self._value(name, value)
            clause, values = self._fingerprint_clause(value) if name == "fingerprint" else (f"{name} = {p}", [value])
            clauses.append(clause)
            args.extend(values)
        return (" WHERE " + " AND ".join(clauses) if clauses else ""), args

    def _fetch(self, sql: str, args: Sequence[Any]) -> list[Any]:
        """Rows of one read; a read that failed because the server had dropped the connection is
        tried once more on a new one (reads are idempotent; writes are retried by their callers)."""
        for attempt in (1, 2):
            try:
                with self._transaction("read") as cur:
                    cur.execute(sql, tuple(args))
                    return list(cur.fetchall())
            except AuditError:
                if attempt == 2 or self._conn is not None:
                    raise
        raise AssertionError("unreachable")

    def query(self, q: Query) -> list[Record]:
        where, args = self._where(q)
        order = " ORDER BY id DESC" if q.newest_first else " ORDER BY id"
        limit = f" LIMIT {int(q.limit)}" if q.limit is not None else ""
        rows = [_row_to_record(r) for r in self._decode(self._fetch(self._select() + where + order + limit, args))]
        return rows

    STREAM_PAGE = 2_000
    """Rows fetched at a time by `iter_query`."""

    def iter_query(self, q: Query) -> Iterator[Record]:
        """`query` as a stream: one statement whose rows are fetched `STREAM_PAGE` at a time, so
        memory stays flat at any result size (``audit query`` prints as it reads).

        Raises:
            AuditError: the store cannot be read.
        """
        where, args = self._where(q)
        order = " ORDER BY id DESC" if q.newest_first else " ORDER BY id"
        limit = f" LIMIT {int(q.limit)}" if q.limit is not None else ""
        for row in self._stream(self._select() + where + order + limit, args):
            yield _row_to_record(row)

    def _stream(self, sql: str, args: Sequence[Any]) -> Iterator[Sequence[Any]]:
        """Rows of one read statement, fetched in pages from one cursor (under the store lock)."""
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
            cur = self._conn.cursor()
            try:
                cur.execute(sql, tuple(args))
                while rows := cur.fetchmany(self.STREAM_PAGE):
                    yield from self._decode(rows)
            except self._db_errors as exc:
                raise self._error(exc)(f"cannot read the audit store {self.url}: {exc}") from None
            finally:
                cur.close()

    def records(self) -> Iterator[Record]:
        last = 0
        while True:
            rows = self._decode(
                self._fetch(self._select() + f" WHERE id > {self.PARAM} ORDER BY id LIMIT 5000", [last])
            )
            if not rows:
                return
            for row in rows:
                yield _row_to_record(row)
            last = int(rows[-1][0])

    def count(self) -> int:
        return int(self._fetch("SELECT COUNT(*) FROM audit_events", [])[0][0])

    def row_batches(self, after: int = 0, size: int = 20_000) -> Iterator[list[tuple[Any, ...]]]:
        """Raw rows (``id``, then `SQL_COLUMNS`) with ``id > after``, in storage order, `size` at a
        time (keyset pages on the primary key: memory bounded by one page at any log size)."""
        sql = self._select() + f" WHERE id > {self.PARAM} ORDER BY id LIMIT {int(size)}"
        while True:
            rows = self._decode(self._fetch(sql, [after]))
            if not rows:
                return
            after = int(rows[-1][0])
            yield rows
            del rows  # one page alive at a time: not this one while the next is fetched

    def position_of(self, writer: str, seq: int, time: str) -> int | None:
        """The storage position (``id``) of record `seq` of chain `writer` stored with event time
        `time` (found through the time index), or None if no such record is stored."""
        p = self.PARAM
        sql = f"SELECT MIN(id) FROM audit_events WHERE time = {p} AND writer = {p} AND seq = {p}"  # noqa: S608
        row = self._fetch(sql, [self._value("time", time), self._value("writer", writer), seq])
        return int(row[0][0]) if row and row[0][0] is not None else None

    def last_position_before(self, time: str) -> int:
        """The highest storage position among records with event time before `time` (0 if none)."""
        row = self._fetch(f"SELECT MAX(id) FROM audit_events WHERE time < {self.PARAM}", [self._value("time", time)])  # noqa: S608
        return int(row[0][0]) if row and row[0][0] is not None else 0

    def delete_positions(self, low: int, high: int, ids: Sequence[int] | None = None) -> int:
        """Delete, in one short transaction, the records with ``low < id <= high`` (all of them, or
        only those in `ids`); returns how many were deleted (`mrtr_keys.audit.retention.prune`).

        Raises:
            AuditError: the store cannot be written.
        """
        p = self.PARAM
        with self._transaction("prune") as cur:
            self._begin(cur)
            if ids is None:
                cur.execute(f"DELETE FROM audit_events WHERE id > {p} AND id <= {p}", (low, high))  # noqa: S608
                return int(cur.rowcount)
            deleted = 0
            for start in range(0, len(ids), 500):
                chunk = list(ids[start : start + 500])
                marks = ", ".join([p] * len(chunk))
                cur.execute(f"DELETE FROM audit_events WHERE id IN ({marks})", chunk)  # noqa: S608
                deleted += int(cur.rowcount)
            return deleted

    def chain_length(self, writer: str, since: str) -> int:
        p = self.PARAM
        # The time index bounds the scan to the events since `since`; `writer` filters them.
        sql = f"SELECT MAX(seq) FROM audit_events WHERE time >= {p} AND writer = {p}"  # noqa: S608 - placeholders only
        row = self._fetch(sql, [self._value("time", since), self._value("writer", writer)])
        return int(row[0][0]) if row and row[0][0] is not None else 0

    def stats(self, by: str, q: Query) -> list[tuple[str | None, int]]:
        """`AuditStore.stats` from the hourly totals (`mrtr_keys.audit.writing.stores.hours`): cost bounded
        by the hours in the window and the events of its partial edge hours, not the log's size.

        Raises:
            ConfigError: `by` is not one of `STATS_KEYS`; AuditError: the store cannot be read.
        """
        if by not in STATS_KEYS:
            raise ConfigError(f"--by must be one of {', '.join(STATS_KEYS)}")
        return self.stats_from_totals(by, q)

    def _scan_stats(self, by: str, q: Query) -> list[tuple[str | None, int]]:
        """Counts by scanning the events matching `q` (the edges of a window, or what the totals cannot answer)."""
        where, args = self._where(q)
        # `by` is one of STATS_KEYS (checked above); values are bound parameters.
        sql = f"SELECT {by}, COUNT(*) AS n FROM audit_events{where} GROUP BY {by} ORDER BY n DESC, {by}"  # noqa: S608
        return [(self._stat_key(by, r[0]), int(r[1])) for r in self._fetch(sql, args)]

    def _stat_key(self, by: str, key: Any) -> Any:
        """A group key of `stats` as written."""
        return key

    def put_instance(self, row: Sequence[object]) -> None:
        p = self.PARAM
        cols = ", ".join(INSTANCE_COLUMNS)
        updates = ", ".join(f"{c} = excluded.{c}" for c in INSTANCE_COLUMNS[1:])
        values = ", ".join([p] * len(INSTANCE_COLUMNS))
        sql = f"INSERT INTO instances ({cols}) VALUES ({values}) ON CONFLICT (name) DO UPDATE SET {updates}"  # noqa: S608 - fixed names
        with self._transaction("write to") as cur:
            self._begin(cur)
            cur.execute(sql, tuple(row))

    def instances(self) -> list[tuple[object, ...]]:
        sql = f"SELECT {', '.join(INSTANCE_COLUMNS)} FROM instances ORDER BY name"  # noqa: S608 - fixed names
        return [tuple(r) for r in self._fetch(sql, [])]

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.close()
                except self._db_errors:
                    pass
                self._conn = None
