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
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from mrtr_keys.audit.stores.sql import SQLStore
from mrtr_keys.errors import AuditError, ConfigError

BUSY_TIMEOUT_MS = 10_000
DEFAULT_FILE = "audit.db"
V4_INDEXES = (
    "DROP INDEX IF EXISTS audit_events_op_kid_time",
    "CREATE INDEX audit_events_kid_op_time ON audit_events (kid, op, time)",
    "CREATE INDEX audit_events_fp8 ON audit_events (substr(fingerprint, 1, 8))",
)
"""Schema 4 on SQLite: ``(kid, op, time)`` serves ``--kid`` alone as well as the rotation gates (kid, op,
time window), and ``query --token`` finds its rows through the first 8 characters of the fingerprint
(a quarter of a full index's width; the full value is then compared)."""


def path_from_url(url: str) -> Path:
    """``sqlite:///abs/path`` or ``sqlite:relative/path`` -> a path.

    Raises:
        ConfigError: no path.
    """
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ConfigError("a sqlite audit URL names a local file: sqlite:///PATH")
    path = unquote(parsed.path)
    if not path:
        raise ConfigError("a sqlite audit URL needs a path: sqlite:///PATH")
    return Path(path)


class SQLiteStore(SQLStore):
    """The audit log in one SQLite file (WAL, mode 0600)."""

    PARAM = "?"
    AUTOINC = "INTEGER PRIMARY KEY AUTOINCREMENT"
    # SQLite before 3.32 allows only 999 bound values per statement (SQLITE_MAX_VARIABLE_NUMBER).
    ROWS_PER_INSERT = 500 if sqlite3.sqlite_version_info >= (3, 32, 0) else 60
    _db_errors = (sqlite3.Error,)
    FINGERPRINT_PREFIX = "substr(fingerprint, 1, 8)"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser().absolute()
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
            raise AuditError(f"cannot open the audit store {self.path}: {exc}") from None
        return _AutoTx(conn)

    def _begin(self, cur: Any) -> None:
        cur.execute("BEGIN IMMEDIATE")

    def _to_v4(self, cur: Any) -> None:
        for stmt in V4_INDEXES:
            cur.execute(stmt)

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
