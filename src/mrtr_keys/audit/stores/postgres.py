"""`postgresql://...`: the audit log in PostgreSQL (psycopg 3), for fleets writing to one place.

Every instance appends its own hash chain; the schema is created and migrated on first open
under a transaction-scoped advisory lock, so instances starting together do not race. A
connection the server dropped (restart, failover, network cut) is replaced on the next call. Needs
the ``postgres`` extra (``pip install 'mrtr-keys[postgres]'``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mrtr_keys.audit.stores.base import SQL_COLUMNS
from mrtr_keys.audit.stores.sql import SQLStore
from mrtr_keys.errors import AuditError, ConfigError
from mrtr_keys.urls import redact

_COPY = f"COPY audit_events ({', '.join(SQL_COLUMNS)}) FROM STDIN"
_MIGRATION_LOCK = 0x6D72_7472_6175  # "mrtrau": the advisory lock id serialising schema migrations


class PostgresStore(SQLStore):
    """The audit log in a PostgreSQL database (tables ``audit_events`` and ``schema_version``)."""

    PARAM = "%s"
    AUTOINC = "BIGSERIAL PRIMARY KEY"

    def __init__(self, url: str) -> None:
        try:
            import psycopg
        except ImportError:
            raise ConfigError("the postgresql audit store needs psycopg: pip install 'mrtr-keys[postgres]'") from None
        self._psycopg = psycopg
        self._dsn = url
        self._db_errors = (psycopg.Error,)
        super().__init__(redact(url))

    def _connect(self) -> Any:
        try:
            return self._psycopg.connect(self._dsn, connect_timeout=10)
        except self._psycopg.Error as exc:
            raise AuditError(f"cannot connect to the audit store {self.url}: {exc}") from None

    def append_rows(self, rows: Sequence[tuple[object, ...]]) -> None:
        """Store `rows` in one transaction with ``COPY ... FROM STDIN`` (binary framing by psycopg;
        far cheaper per row than ``INSERT``)."""
        if not rows:
            return
        with self._transaction("write to") as cur, cur.copy(_COPY) as copy:
            write = copy.write_row
            for row in rows:
                write(row)

    def _broken(self, conn: Any) -> bool:
        return bool(conn.closed or conn.broken)

    def _lock_schema(self, cur: Any) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
