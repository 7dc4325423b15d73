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
from collections.abc import Sequence
from typing import Any

from mrtr_keys.audit.stores.base import SQL_COLUMNS
from mrtr_keys.audit.stores.sql import SQLStore
from mrtr_keys.deadlines import WATCHDOG
from mrtr_keys.errors import AuditError, ConfigError
from mrtr_keys.urls import redact

_COPY = f"COPY audit_events ({', '.join(SQL_COLUMNS)}) FROM STDIN"
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


def chain_lock(writer: str) -> int:
    """The transaction-scoped advisory lock id of chain `writer` (a signed 64-bit hash of its name)."""
    return int.from_bytes(hashlib.blake2b(writer.encode(), digest_size=8).digest(), "big", signed=True)


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
            return self._psycopg.connect(self._dsn, connect_timeout=CONNECT_TIMEOUT, **KEEPALIVES)
        except self._psycopg.Error as exc:
            raise AuditError(f"cannot connect to the audit store {self.url}: {exc}") from None

    def append_rows(self, rows: Sequence[tuple[object, ...]]) -> None:
        """Store `rows` in one transaction with ``COPY ... FROM STDIN`` (binary framing by psycopg;
        far cheaper per row than ``INSERT``)."""
        if not rows:
            return
        with self._transaction("write to") as cur:
            # Held until this transaction ends, so `chain_length` cannot answer while it is in flight.
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (chain_lock(str(rows[0][_WRITER_COLUMN])),))
            with cur.copy(_COPY) as copy:
                write = copy.write_row
                for row in rows:
                    write(row)

    def chain_length(self, writer: str, since: str) -> int:
        """`AuditStore.chain_length`, after any transaction of chain `writer` still in flight has
        ended (its advisory lock, taken by `append_rows`; waited for up to `CHAIN_LOCK_WAIT_MS`): a
        commit whose answer was lost with its connection may still be running on the server, and
        the count must include it (issue 22).

        Raises:
            AuditError: the store cannot be read, or the chain's last transaction has not ended.
        """
        with self._transaction("read") as cur:
            cur.execute(f"SET LOCAL lock_timeout = {CHAIN_LOCK_WAIT_MS}")
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (chain_lock(writer),))
            cur.execute("SELECT MAX(seq) FROM audit_events WHERE time >= %s AND writer = %s", (since, writer))
            row = cur.fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def _migrate(self) -> None:
        with WATCHDOG.guard(self._conn.fileno(), READ_DEADLINE):
            super()._migrate()

    def _deadline(self, verb: str) -> Any:
        return WATCHDOG.guard(self._conn.fileno(), READ_DEADLINE if verb == "read" else WRITE_DEADLINE)

    def _broken(self, conn: Any) -> bool:
        return bool(conn.closed or conn.broken)

    def _lock_schema(self, cur: Any) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
