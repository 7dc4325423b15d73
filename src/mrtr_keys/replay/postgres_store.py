"""``postgresql://...``: consume-once records in PostgreSQL, one ``INSERT ... ON CONFLICT DO NOTHING``.

Schema (created on first use under a transaction-scoped advisory lock, so instances starting
together do not race)::

    CREATE TABLE mrtr_replay_tokens (id bytea PRIMARY KEY, expires_at timestamptz NOT NULL);
    CREATE INDEX mrtr_replay_tokens_expires ON mrtr_replay_tokens (expires_at);
    CREATE TABLE mrtr_replay_key (id smallint PRIMARY KEY, key bytea NOT NULL);

The primary key makes the insert atomic: of concurrent inserts of one id exactly one reports a row
(PostgreSQL docs, INSERT "ON CONFLICT DO NOTHING"). An expired row still blocks its id until it
is purged, which only matters for a token that is itself expired by then (refused before the store).
A background thread deletes expired rows every `purge_interval` seconds in batches of
`PURGE_BATCH` rows, at most `PURGE_MAX_BATCHES` batches a pass (``FOR UPDATE SKIP LOCKED``, so the
purgers of a fleet do not queue behind each other).

Connections: a small pool of at most `POOL_SIZE` (a caller waits up to the timeout for one); a
connection that fails is dropped and the next call opens a new one, so the store recovers by itself
when the database is back.

Deadlines (client side, so a silent server fails a call instead of hanging it; issue 22): the whole
call, from waiting for a pooled connection to the answer, is bounded by `timeout` (default 1 s).
A statement runs under `mrtr_keys.deadlines.WATCHDOG`, which shuts the socket down at the deadline
(libpq has no read or write timeout); a new connection is opened in a helper thread the caller waits
for at most the time left (psycopg's own ``connect_timeout`` cannot go below 2 s), and one that
succeeds late joins the pool if it has room (a connection handed back to a full pool is closed).
``statement_timeout`` (the same `timeout`) also stops the statement on the server.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

from mrtr_keys.deadlines import WATCHDOG
from mrtr_keys.errors import ConfigError, bare
from mrtr_keys.replay.store import KEY_BYTES, Health, redact

log = logging.getLogger("mrtr_keys.replay")

POOL_SIZE = 8
PURGE_BATCH = 1000
PURGE_MAX_BATCHES = 20
DEFAULT_PURGE_INTERVAL = 60.0
_SCHEMA_LOCK = 0x6D72_7472_7270  # "mrtrrp": the advisory lock id serialising schema creation

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS mrtr_replay_tokens (id bytea PRIMARY KEY, expires_at timestamptz NOT NULL)",
    "CREATE INDEX IF NOT EXISTS mrtr_replay_tokens_expires ON mrtr_replay_tokens (expires_at)",
    "CREATE TABLE IF NOT EXISTS mrtr_replay_key (id smallint PRIMARY KEY, key bytea NOT NULL)",
)
_CONSUME = (
    "INSERT INTO mrtr_replay_tokens (id, expires_at) VALUES (%s, now() + %s * interval '1 millisecond') "
    "ON CONFLICT DO NOTHING"
)
_PURGE = (
    "DELETE FROM mrtr_replay_tokens WHERE id IN (SELECT id FROM mrtr_replay_tokens WHERE expires_at < now() "
    "LIMIT %s FOR UPDATE SKIP LOCKED)"
)


class PostgresReplayStore:
    """A `ReplayStore` on PostgreSQL (psycopg 3).

    Args:
        url: a libpq URL, ``postgresql://USER[:PASSWORD]@HOST:PORT/DB``.
        timeout: seconds to connect, and the statement timeout of every call.
        purge_interval: seconds between purges of expired rows (the thread starts on first use).

    Raises:
        ConfigError: the ``postgres`` extra is missing.
    """

    def __init__(self, url: str, *, timeout: float, purge_interval: float = DEFAULT_PURGE_INTERVAL) -> None:
        try:
            import psycopg
        except ImportError:
            raise ConfigError("the postgresql replay store needs psycopg: pip install 'mrtr-keys[postgres]'") from None
        self._psycopg = psycopg
        self._dsn = url
        self.url = redact(url)
        self._timeout = timeout
        self._errors: tuple[type[BaseException], ...] = (psycopg.Error, OSError)
        self._call_errors: tuple[type[BaseException], ...] = (*self._errors, TimeoutError)
        self._idle: queue.LifoQueue[Any] = queue.LifoQueue(POOL_SIZE)
        self._slots = threading.BoundedSemaphore(POOL_SIZE)
        self._health = Health(self.url)
        self._schema_ready = False
        self._key: bytes | None = None
        self._purge_interval = purge_interval
        self._stop = threading.Event()
        self._purger: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"PostgresReplayStore({self.url!r})"

    @property
    def healthy(self) -> bool:
        return self._health.healthy

    @property
    def down_since(self) -> float | None:
        """POSIX time since which calls fail (None while they succeed)."""
        return self._health.down_since

    # ------------------------------------------------------------ connections

    def _connect(self) -> Any:
        conn = self._psycopg.connect(
            self._dsn,
            autocommit=True,
            connect_timeout=max(2, round(self._timeout)),
            options=f"-c statement_timeout={int(self._timeout * 1000)}",
        )
        if not self._schema_ready:
            try:
                with WATCHDOG.guard(conn.fileno(), max(self._timeout, 5.0)), conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                    for statement in _SCHEMA:
                        conn.execute(statement)
            except BaseException:
                conn.close()
                raise
            self._schema_ready = True
        return conn

    def _connect_within(self, seconds: float) -> Any:
        """A new connection, waiting at most `seconds` (see the module docstring: one that is made
        later joins the pool, or is closed if the pool is full).

        Raises:
            TimeoutError: not connected in time (at once if `seconds` is not above 0: the caller's
                deadline passed while it waited for a pool slot). psycopg.Error, OSError: the connection failed.
        """
        if seconds <= 0:
            raise TimeoutError("connect timed out")
        box: queue.Queue[tuple[Any, BaseException | None]] = queue.Queue(1)
        late = threading.Event()

        def connect() -> None:
            try:
                conn = self._connect()
            except BaseException as exc:  # handed to the caller (nothing to do if it left)
                box.put((None, bare(exc)))
                return
            box.put((conn, None))
            if late.is_set():
                self._adopt(box)

        threading.Thread(target=connect, name="mrtr-replay-connect", daemon=True).start()
        try:
            conn, exc = box.get(timeout=max(0.0, seconds))
        except queue.Empty:
            late.set()
            if not box.empty():  # finished just now
                self._adopt(box)
            raise TimeoutError("connect timed out") from None
        if exc is not None:
            raise exc
        return conn

    def _adopt(self, box: queue.Queue[tuple[Any, BaseException | None]]) -> None:
        try:
            conn, _ = box.get_nowait()
        except queue.Empty:
            return
        if conn is not None:
            self._return(conn)

    def _return(self, conn: Any) -> None:
        """Put `conn` back in the pool, or close it if the pool is full (connections made late, after
        their caller left, join it without a caller's slot: after an outage they can fill it)."""
        try:
            self._idle.put_nowait(conn)
        except queue.Full:
            conn.close()

    def _run(self, fn: Any) -> Any:
        """Call `fn(conn)` on a pooled connection within the deadline; a failing connection is
        closed, never reused.

        Raises:
            ReplayStoreUnavailable: no connection, the statement failed, or the deadline passed.
        """
        deadline = time.monotonic() + self._timeout
        if not self._slots.acquire(timeout=self._timeout):
            raise self._health.failed(TimeoutError("no free connection"))
        try:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = None
            guard = None
            try:
                if conn is None:
                    conn = self._connect_within(deadline - time.monotonic())
                with WATCHDOG.guard(conn.fileno(), max(0.05, deadline - time.monotonic())) as guard:
                    result = fn(conn)
            except self._call_errors as exc:
                if conn is not None:
                    conn.close()
                timed_out = isinstance(exc, TimeoutError) or (guard is not None and guard.fired)
                raise self._health.failed(TimeoutError("deadline passed") if timed_out else exc) from None
            self._return(conn)
        finally:
            self._slots.release()
        self._health.ok()
        self._start_purger()
        return result

    # ------------------------------------------------------------ the contract

    def consume(self, token_id: bytes, ttl_ms: int) -> bool:
        """``INSERT ... ON CONFLICT DO NOTHING``: True if this call inserted the row.

        Raises:
            ReplayStoreUnavailable: the database is unreachable or the statement failed.
        """
        rowcount: int = self._run(lambda conn: conn.execute(_CONSUME, (token_id, ttl_ms)).rowcount)
        return rowcount == 1

    def hmac_key(self) -> bytes:
        """The fleet's HMAC key (row 1 of ``mrtr_replay_key``, inserted by the first instance; cached).

        Raises:
            ReplayStoreUnavailable: the database is unreachable, or the stored key is not 32 bytes.
        """
        if self._key is not None:
            return self._key

        def load(conn: Any) -> Any:
            conn.execute(
                "INSERT INTO mrtr_replay_key (id, key) VALUES (1, %s) ON CONFLICT DO NOTHING", (os.urandom(KEY_BYTES),)
            )
            row = conn.execute("SELECT key FROM mrtr_replay_key WHERE id = 1").fetchone()
            return None if row is None else bytes(row[0])

        key = self._run(load)
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise self._health.failed(ValueError("bad mrtr_replay_key row"))
        self._key = key
        return key

    def ping(self) -> bool:
        try:
            self._run(lambda conn: conn.execute("SELECT 1").fetchone())
        except self._errors:
            return False
        except Exception:
            return False
        return True

    def purge_once(self) -> int:
        """Delete expired rows in batches of `PURGE_BATCH`, at most `PURGE_MAX_BATCHES`; returns the count.

        Raises:
            ReplayStoreUnavailable: the database is unreachable.
        """
        total = 0
        for _ in range(PURGE_MAX_BATCHES):
            deleted: int = self._run(lambda conn: conn.execute(_PURGE, (PURGE_BATCH,)).rowcount)
            total += deleted
            if deleted < PURGE_BATCH:
                break
        return total

    # ------------------------------------------------------------ background purge

    def _start_purger(self) -> None:
        if self._purger is not None or self._stop.is_set():
            return
        with self._start_lock:
            if self._purger is None:
                self._purger = threading.Thread(target=self._purge_loop, name="mrtr-replay-purge", daemon=True)
                self._purger.start()

    def _purge_loop(self) -> None:
        while not self._stop.wait(self._purge_interval):
            try:
                self.purge_once()
            except Exception as exc:  # logged by Health once per outage; retried next interval
                log.debug("replay purge failed: %s", type(exc).__name__)

    def close(self) -> None:
        """Stop the purge thread and close pooled connections."""
        self._stop.set()
        purger = self._purger
        if purger is not None and purger is not threading.current_thread():
            purger.join(timeout=5)
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                break
