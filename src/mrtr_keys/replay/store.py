"""The consume-once store behind single-use requestState: the contract and ``open_store(url)``.

A store answers one question atomically for a whole fleet: "was this id consumed before?".
`consume(id, ttl_ms)` records `id` and returns True the first time, False every later time until
the record expires after `ttl_ms` milliseconds. Two stores ship (docs/single-use.md):

* ``redis://HOST:PORT/DB`` (or ``rediss://``): ``SET key 1 NX PX ttl`` (redis-py, the ``redis`` extra);
* ``postgresql://...`` (or ``postgres://``): ``INSERT ... ON CONFLICT DO NOTHING`` on a primary key
  (psycopg 3, the ``postgres`` extra); the table is created on first use, expired rows purged in the
  background.

Both also keep the fleet's HMAC key (`hmac_key`): 32 random bytes created on first use with the
same first-writer-wins primitive, so every instance sharing the store hashes a token the same way.
A store never sees a token, only HMAC-SHA256(key, token bytes) truncated to `ID_BYTES`.

Failures raise `ReplayStoreUnavailable`; the store tracks its health (`healthy`) and logs one line
when it goes down and one when it is back. Clients reconnect by themselves on the next call.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol
from urllib.parse import urlsplit

from mrtr_keys.errors import ConfigError, ReplayStoreUnavailable
from mrtr_keys.urls import redact as redact  # re-exported for the stores

log = logging.getLogger("mrtr_keys.replay")

ID_BYTES = 16
"""Length of a consumed-token id (bytes): a truncated HMAC-SHA256 (128 bits, no practical collision)."""
KEY_BYTES = 32
"""Length of the fleet's HMAC key (bytes)."""
DEFAULT_TIMEOUT = 1.0
"""Seconds a store call may take (connect or answer) before it counts as a failure."""


class ReplayStore(Protocol):
    """What the guard needs from a store (thread-safe; every method may raise `ReplayStoreUnavailable`)."""

    url: str
    """The store's URL with any password replaced by ``***`` (safe to log)."""

    def consume(self, token_id: bytes, ttl_ms: int) -> bool:
        """Record `token_id` for `ttl_ms` milliseconds; True if it was not recorded before."""
        ...

    def hmac_key(self) -> bytes:
        """The fleet's 32-byte HMAC key, created on first use (first writer wins)."""
        ...

    def ping(self) -> bool:
        """True if the store answers now (for readiness); never raises."""
        ...

    def close(self) -> None:
        """Release connections and stop background work."""
        ...


class Health:
    """Up/down state of one store: one log line per transition, never one per failed call."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._lock = threading.Lock()
        self.healthy = True
        self.down_since: float | None = None
        """POSIX time of the first failure of the current outage (None while healthy)."""

    def failed(self, exc: BaseException) -> ReplayStoreUnavailable:
        """Mark the store down (logging once) and return the error to raise (no detail of the call)."""
        with self._lock:
            was, self.healthy = self.healthy, False
            if was:
                self.down_since = time.time()
        if was:
            log.warning("replay store %s unreachable: %s", self._url, type(exc).__name__)
        return ReplayStoreUnavailable(f"replay store {self._url} unreachable: {type(exc).__name__}")

    def ok(self) -> None:
        if not self.healthy:
            with self._lock:
                was, self.healthy = self.healthy, True
                self.down_since = None
            if not was:
                log.warning("replay store %s reachable again", self._url)


def open_store(url: str, *, timeout: float = DEFAULT_TIMEOUT) -> ReplayStore:
    """The store at `url` (no connection is made yet: the first `consume` connects).

    Redis URLs may add ``?prefix=TEXT`` (default ``mrtr:replay:``) to keep several fleets in one
    database. `timeout` is the seconds any one call may take.

    Raises:
        ConfigError: unknown scheme, bad URL, or the extra (``redis`` / ``postgres``) not installed.
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError("single_use needs a store URL: redis://HOST:PORT/DB or postgresql://USER@HOST/DB")
    if not (isinstance(timeout, int | float) and 0 < timeout <= 60):
        raise ConfigError("the replay store timeout must be a number of seconds above 0 and at most 60")
    scheme = url.partition(":")[0].lower()
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises for a port that is not a number from 0 to 65535
    except ValueError as exc:  # an unclosed "[", a bad port
        raise ConfigError(f"bad replay store URL {redact(url)}: {exc}") from None
    if scheme in ("redis", "rediss"):
        db = parts.path[1:]
        if db and not (db.isascii() and db.isdigit()):  # redis-py would quietly use database 0 for ``/abc``
            raise ConfigError(
                f"bad redis replay store URL {redact(url)}: the database must be a number, as in redis://HOST:PORT/0"
            )
        from mrtr_keys.replay.redis_store import RedisReplayStore

        return RedisReplayStore(url, timeout=float(timeout))
    if scheme in ("postgresql", "postgres"):
        from mrtr_keys.replay.postgres_store import PostgresReplayStore

        return PostgresReplayStore(url, timeout=float(timeout))
    raise ConfigError(
        f"unsupported replay store URL scheme {scheme!r} (use redis://HOST:PORT/DB or postgresql://USER@HOST/DB)"
    )
