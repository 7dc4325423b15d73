"""The schema of the SQL stores: created or brought up to date on open, and ``audit migrate`` (schemas 4 and 5)."""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from mrtr_keys.audit.writing.stores.base import AUTO_SCHEMA, SCHEMA_VERSION, SQL_MIGRATIONS
from mrtr_keys.errors import AuditError, ConfigError

STORE_META = "CREATE TABLE IF NOT EXISTS store_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)"
"""Facts about the store itself (``store_id``): not versioned, created on any open that lacks it."""
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class SchemaSteps:
    """Mixin of `mrtr_keys.audit.writing.stores.sql.SQLStore`: the migrations (a dialect supplies `_upgrade`)."""

    PARAM: str
    AUTOINC: str
    _db_errors: tuple[type[BaseException], ...]
    _lock: threading.RLock
    _conn: Any
    version: int
    store_id: str | None = None
    """The store's random id (`store_meta`), set on open; checkpoints are matched by it
    (`mrtr_keys.audit.verifying.store_match`). A byte-for-byte copy of the store keeps it."""

    @property
    def url(self) -> str:
        raise NotImplementedError

    def _connect(self) -> Any:
        raise NotImplementedError

    def _fetch(self, sql: str, args: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def _transaction(self, verb: str) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def _begin(self, cur: Any) -> None:
        """Start a write transaction (psycopg starts one implicitly)."""

    def _lock_schema(self, cur: Any) -> None:
        """Serialise concurrent migrations (inside the migration transaction)."""

    def _lock_events(self, cur: Any) -> None:
        """Make writers of the events wait until this transaction ends, before `migrate` counts them (SQLite:
        BEGIN IMMEDIATE did)."""

    def _migrate(self) -> None:
        """Create a new store at `SCHEMA_VERSION`; bring an existing one up to `AUTO_SCHEMA` (the
        cheap steps); refuse a store newer than this code. Sets `version`."""
        with self._lock:
            cur = self._conn.cursor()
            self._begin(cur)
            try:
                self._lock_schema(cur)
                cur.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
                current = self._current_version(cur)
                if current > SCHEMA_VERSION:
                    raise ConfigError(
                        f"the audit store {self.url} has schema version {current}, newer than this mrtr-keys "
                        f"({SCHEMA_VERSION}); upgrade mrtr-keys"
                    )
                for version in range(current + 1, AUTO_SCHEMA + 1):
                    for stmt in SQL_MIGRATIONS[version]:
                        cur.execute(stmt.format(autoinc=self.AUTOINC))
                    cur.execute(f"INSERT INTO schema_version (version) VALUES ({self.PARAM})", (version,))  # noqa: S608
                if current == 0:  # a new store: straight to the current layout (an empty table to convert)
                    self._upgrade(cur, AUTO_SCHEMA)
                    cur.execute(f"INSERT INTO schema_version (version) VALUES ({self.PARAM})", (SCHEMA_VERSION,))  # noqa: S608
                self._make_hours(cur)
                self._make_usage(cur)
                self.store_id = self._store_id(cur)
                self._conn.commit()
                self.version = self._current_version(cur)
            except BaseException:
                self._conn.rollback()
                raise

    def _store_id(self, cur: Any) -> str:
        """The store id from ``store_meta``, made (32 random hex digits) if the store has none yet: a
        new store, or one first opened by a mrtr-keys with store ids (inside the migration
        transaction, under the schema lock, so processes opening the store together agree)."""
        cur.execute(STORE_META)
        p = self.PARAM
        cur.execute(
            f"INSERT INTO store_meta (name, value) SELECT {p}, {p} "  # noqa: S608 - fixed names
            "WHERE NOT EXISTS (SELECT 1 FROM store_meta WHERE name = 'store_id')",
            ("store_id", secrets.token_hex(16)),
        )
        cur.execute("SELECT value FROM store_meta WHERE name = 'store_id'")
        value = str(cur.fetchone()[0])
        if not _ID.fullmatch(value):  # it reaches messages and checkpoint files: never arbitrary text
            raise AuditError(f"the audit store {self.url} has a malformed store id in store_meta")
        return value

    def meta(self, name: str) -> str | None:
        """The value of `name` in ``store_meta`` (None: not set).

        Raises:
            AuditError: the store cannot be read.
        """
        rows = self._fetch(f"SELECT value FROM store_meta WHERE name = {self.PARAM}", [name])  # noqa: S608
        return str(rows[0][0]) if rows else None

    def put_meta_once(self, name: str, value: str) -> str:
        """Set `name` in ``store_meta`` to `value` unless it is set already; returns the value it holds
        (yours, or the one another process set first: one transaction, so the first one wins).

        Raises:
            AuditError: the store cannot be written.
        """
        p = self.PARAM
        with self._transaction("write to") as cur:
            self._begin(cur)
            insert = f"INSERT INTO store_meta (name, value) VALUES ({p}, {p}) ON CONFLICT (name) DO NOTHING"  # noqa: S608
            cur.execute(insert, (name, value))
            cur.execute(f"SELECT value FROM store_meta WHERE name = {p}", (name,))  # noqa: S608
            return str(cur.fetchone()[0])

    def last_position(self) -> int:
        """The highest storage position in use (0: no record)."""
        row = self._fetch("SELECT MAX(id) FROM audit_events", [])
        return int(row[0][0]) if row and row[0][0] is not None else 0

    @staticmethod
    def _current_version(cur: Any) -> int:
        cur.execute("SELECT MAX(version) FROM schema_version")
        row = cur.fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def _make_hours(self, cur: Any) -> None:
        """Create the hourly totals if missing (`mrtr_keys.audit.writing.stores.hours.HourTotals`)."""
        raise NotImplementedError

    def _make_usage(self, cur: Any) -> None:
        """Create ``key_usage`` if missing (`mrtr_keys.audit.writing.stores.key_usage.SQLKeyUsage`)."""
        raise NotImplementedError

    def _upgrade(self, cur: Any, current: int) -> None:
        """Schema `current` (3 or 4) -> `SCHEMA_VERSION` in the dialect (inside the migration transaction)."""
        raise NotImplementedError

    def migrate(self) -> tuple[int, int, int]:
        """``mrtr-keys audit migrate``: bring this store from schema 3 or 4 to `SCHEMA_VERSION` in one
        transaction, keeping every event with its storage position; returns (from, to, events).

        Raises:
            ConfigError: the store is already at `SCHEMA_VERSION` (the migration runs once);
            AuditError: the store cannot be read or written, or the copy lost events (rolled back).
        """
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
            cur = self._conn.cursor()
            try:
                self._begin(cur)
                self._lock_schema(cur)
                self._lock_events(cur)  # else an append between the count and the copy fails the count check
                current = self._current_version(cur)
                if current >= SCHEMA_VERSION:
                    raise ConfigError(
                        f"the audit store {self.url} is already at schema version {current}: nothing to migrate"
                    )
                cur.execute("SELECT COUNT(*) FROM audit_events")
                before = int(cur.fetchone()[0])
                self._upgrade(cur, current)
                cur.execute("SELECT COUNT(*) FROM audit_events")
                after = int(cur.fetchone()[0])
                if after != before:
                    raise AuditError(f"migration of {self.url} kept {after} of {before} events: rolled back")
                cur.execute(f"INSERT INTO schema_version (version) VALUES ({self.PARAM})", (SCHEMA_VERSION,))  # noqa: S608
                self._conn.commit()
            except self._db_errors as exc:
                self._conn.rollback()
                raise AuditError(f"cannot migrate the audit store {self.url}: {exc}") from None
            except BaseException:
                self._conn.rollback()
                raise
            self.version = SCHEMA_VERSION
            return current, SCHEMA_VERSION, after
