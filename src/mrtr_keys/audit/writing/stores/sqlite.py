"""`sqlite:///PATH`: the embedded default store, a file beside the key ring, in WAL mode.

WAL lets the CLI read while codecs and the sidecar write, and several processes append at
once (each waits up to `BUSY_TIMEOUT_MS` for the write lock). The file is created mode 0600.
Processes opening a new file together (a fleet starting at once) wait for each other's WAL switch
and schema creation instead of failing with "database is locked".
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from mrtr_keys.audit.writing.stores import narrow
from mrtr_keys.audit.writing.stores.base import SCHEMA_VERSION, SQL_COLUMNS
from mrtr_keys.audit.writing.stores.narrow_sql import NarrowRows
from mrtr_keys.audit.writing.stores.sql import SQLStore
from mrtr_keys.errors import AuditError, AuditUnavailable, ConfigError

NARROW = 4
"""The first schema with narrow rows (`narrow`); schema 5 stores the same rows."""

_SELECT = "SELECT id, " + ", ".join(SQL_COLUMNS) + " FROM audit_events"  # noqa: S608 - fixed column names
BUSY_TIMEOUT_MS = 10_000
DEFAULT_FILE = "audit.db"


def path_from_url(url: str) -> Path:
    """``sqlite:///abs/path`` or ``sqlite:relative/path`` -> a path.

    Raises:
        ConfigError: no path.
    """
    try:
        parsed = urlparse(url)
    except ValueError as exc:  # "sqlite://[::1/x": an unclosed IPv6 host
        raise ConfigError(f"cannot read the audit store URL {url!r}: {exc} (sqlite:///PATH)") from None
    if parsed.netloc not in ("", "localhost"):
        raise ConfigError("a sqlite audit URL names a local file: sqlite:///PATH")
    path = unquote(parsed.path)
    if not path:
        raise ConfigError("a sqlite audit URL needs a path: sqlite:///PATH")
    return Path(path)


class SQLiteStore(NarrowRows, SQLStore):
    """The audit log in one SQLite file (WAL, mode 0600)."""

    PARAM = "?"
    AUTOINC = "INTEGER PRIMARY KEY AUTOINCREMENT"
    # SQLite before 3.32 allows only 999 bound values per statement (SQLITE_MAX_VARIABLE_NUMBER).
    ROWS_PER_INSERT = 500 if sqlite3.sqlite_version_info >= (3, 32, 0) else 60
    _db_errors = (sqlite3.Error,)

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser().absolute()
        self._init_narrow()
        super().__init__("sqlite:///" + str(self.path).lstrip("/"))

    def _connect(self) -> Any:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.path.exists():
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
            conn = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False, isolation_level=None
            )
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            _wait_busy(lambda: conn.execute("PRAGMA journal_mode = WAL"))
            conn.execute("PRAGMA synchronous = NORMAL")
        except (OSError, sqlite3.Error) as exc:
            raise AuditUnavailable(f"cannot open the audit store {self.path}: {exc}") from None
        return _AutoTx(conn)

    def _begin(self, cur: Any) -> None:
        cur.execute("BEGIN IMMEDIATE")

    def _upgrade(self, cur: Any, current: int) -> None:
        """Schema 4 -> 5: one index replaced (`narrow.TO_V5`). Schema 3 -> 5: every row copied, with its id,
        into the narrow table (`narrow`), in pages, then the schema-5 indexes."""
        if current == NARROW:
            for stmt in narrow.TO_V5:
                cur.execute(stmt)
            return
        cur.execute("SELECT seq FROM sqlite_sequence WHERE name = 'audit_events'")
        seq_row = cur.fetchone()
        cur.execute(narrow.NAMES)
        cur.execute(narrow.TABLE)
        codec = narrow.Codec()
        cols = ", ".join(SQL_COLUMNS)
        marks = ", ".join(["?"] * (len(SQL_COLUMNS) + 1))
        insert = f"INSERT INTO audit_events_v4 (id, {cols}) VALUES ({marks})"  # noqa: S608 - fixed names
        select = f"SELECT id, {cols} FROM audit_events WHERE id > ? ORDER BY id LIMIT 5000"  # noqa: S608
        last = 0
        while rows := cur.execute(select, (last,)).fetchall():
            encoded = codec.encode_rows([r[1:] for r in rows], lambda name: self._name_id(cur, name, codec.learn))
            cur.executemany(insert, [(r[0], *e) for r, e in zip(rows, encoded, strict=True)])
            last = rows[-1][0]
        cur.execute("DROP TABLE audit_events")
        cur.execute("ALTER TABLE audit_events_v4 RENAME TO audit_events")
        for stmt in narrow.INDEXES:
            cur.execute(stmt)
        if seq_row is not None:  # ids never reused, as before
            cur.execute("UPDATE sqlite_sequence SET seq = MAX(seq, ?) WHERE name = 'audit_events'", (seq_row[0],))
        self._codec = narrow.Codec()

    def _narrow(self) -> bool:
        return self.version >= NARROW

    def _fingerprint_clause(self, value: Any) -> tuple[str, list[Any]]:
        if not self._narrow():
            return super()._fingerprint_clause(value)
        return narrow.fingerprint_clause(self.version), [value[:4], value]

    def run_pages(self, after: int = 0, size: int = 20_000) -> tuple[narrow.Pieces, Iterator[list[narrow.Run]]] | None:
        """`row_batches` for ``verify``'s hot loop: (the view, pages of `narrow.Run` s: raw rows
        rendered to the text their chain hash reads); None before schema 4 (use `row_batches`)."""
        if not self._narrow():
            return None
        view = self.piece_view()
        sql = _SELECT + f" WHERE id > ? ORDER BY id LIMIT {int(size)}"

        def pages(last: int) -> Iterator[list[narrow.Run]]:
            while rows := self._fetch(sql, [last]):
                last = int(rows[-1][0])
                yield view.runs(rows)
                del rows

        return view, pages(after)

    def piece_view(self) -> narrow.Pieces:
        """A `narrow.Pieces` over this store (schema 4)."""
        sql = _SELECT + " WHERE id >= ? AND id <= ? ORDER BY id"
        return narrow.Pieces(self._codec, self._names, lambda lo, hi: self._decode(self._fetch(sql, [lo, hi])))

    def reader(self) -> tuple[Callable[[], Any], str]:
        """(connect, select of a range ``lo < id <= hi``) for a reading child of ``verify``
        (`mrtr_keys.audit.verifying.verify_parallel`): its own connection, never this one."""
        path = str(self.path)
        return lambda: sqlite3.connect(path, timeout=10), _SELECT + " WHERE id > ? AND id <= ? ORDER BY id"

    def position_span(self, after: int) -> tuple[int, int]:
        """(lowest position after `after`, minus 1; highest position), or (after, after) if none."""
        low, high = self._fetch("SELECT MIN(id), MAX(id) FROM audit_events WHERE id > ?", [after])[0]
        return (after, after) if low is None else (int(low) - 1, int(high))

    def _time_window(self, since: str | None, until: str | None) -> tuple[str, list[Any]]:
        """Schema 4 stores canonical times as integers and any other text as it is (integers sort
        before text): one range over the integers, and one over the text if the store holds any
        (never written by mrtr-keys itself), so a window means what it meant over text."""
        if not self._narrow():
            return super()._time_window(since, until)
        low, high = self._codec.encode_time(since), self._codec.encode_time(until)
        if not isinstance(low, int | None) or not isinstance(high, int | None):
            return super()._time_window(since, until)  # an odd bound: compared as given
        if not self._fetch("SELECT 1 FROM audit_events WHERE time >= '' LIMIT 1", []):  # the index's end
            parts = [c for c, v in (("time >= ?", low), ("time < ?", high)) if v is not None]
            return " AND ".join(parts), [v for v in (low, high) if v is not None]  # one range (the usual case)
        ints = [
            "time >= ?" if low is not None else "time >= -9223372036854775808",
            "time < ?" if high is not None else "time < ''",
        ]
        texts = ["time >= ?" if since is not None else "time >= ''", *(["time < ?"] if until is not None else [])]
        values = [v for v in (low, high, since, until) if v is not None]
        return f"({' AND '.join(ints)} OR {' AND '.join(texts)})", values

    def chain_length(self, writer: str, since: str) -> int:
        """`AuditStore.chain_length`, in the layout the file has now (a writer that opened it before
        ``audit migrate`` asks this after a failed append: its answer must count the migrated rows)."""
        if self.version < SCHEMA_VERSION:
            self.version = int(self._fetch("SELECT MAX(version) FROM schema_version", [])[0][0] or 0)
        return super().chain_length(writer, since)

    # The hourly totals (`mrtr_keys.audit.writing.stores.hours`) over the narrow layout.
    def _hour_window(self, hour: str) -> tuple[str, list[Any]]:
        text, values = super()._hour_window(hour)
        start = self._codec.encode_time(hour + ":00:00.000000Z") if self._narrow() else None
        if not isinstance(start, int):
            return text, values
        return f"(time >= ? AND time < ?) OR ({text})", [start, start + 3_600_000_000, *values]

    def _odd_clause(self) -> str:
        return ("time >= '' AND " if self._narrow() else "") + super()._odd_clause()

    def _error(self, exc: BaseException) -> type[AuditError]:
        """An outage: the file is locked past `BUSY_TIMEOUT_MS`, cannot be opened, or an I/O error."""
        text = str(exc).lower()
        outage = ("locked", "busy", "unable to open", "disk i/o", "readonly", "disk is full")
        return AuditUnavailable if any(w in text for w in outage) else AuditError

    def _migrate(self) -> None:
        _wait_busy(super()._migrate)


def _wait_busy(step: Callable[[], object]) -> None:
    """Run `step`, retrying while SQLite says the database is busy or locked, up to `BUSY_TIMEOUT_MS`.

    SQLite returns SQLITE_BUSY at once, without calling the busy handler, when waiting could
    deadlock, e.g. two connections switching one new file to WAL together, or upgrading a read
    to a write. Instances starting together on a fresh ring do exactly that: wait, do not fail.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    delay = 0.005
    while True:
        try:
            step()
            return
        except sqlite3.OperationalError as exc:
            text = str(exc)
            if ("locked" not in text and "busy" not in text) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


class _AutoTx:
    """A sqlite3 connection in autocommit mode with explicit BEGIN, giving commit/rollback that are
    no-ops outside a transaction (so reads need no transaction and writes take the lock up front)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def cursor(self) -> sqlite3.Cursor:
        return self._conn.cursor()

    def execute(self, sql: str) -> sqlite3.Cursor:
        return self._conn.execute(sql)

    def commit(self) -> None:
        if self._conn.in_transaction:
            self._conn.execute("COMMIT")

    def rollback(self) -> None:
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def close(self) -> None:
        self._conn.close()
