"""``redis://HOST:PORT/DB``: consume-once records in Redis, one ``SET key 1 NX PX ttl`` per token.

``SET ... NX`` is atomic on the server, so of any number of concurrent callers across a fleet exactly
one gets OK (https://redis.io/docs/latest/commands/set/); ``PX`` makes Redis forget the record when
the token can no longer be accepted, so nothing needs purging. Keys are ``PREFIX + hex(id)``; the
fleet's HMAC key is ``PREFIX + "hmac-key"``.

No command is retried: a retried ``SET NX`` whose first attempt reached the server would answer
"consumed" to the one legitimate caller. A failed call raises `ReplayStoreUnavailable` and drops the
connection; the next call connects again (no restart needed).

Each thread keeps one connection of its own (made by redis-py's pool, used with its public
`send_command` / `read_response`), instead of checking one out of the pool per command: a checkout
probes the connection for stray data (three system calls) and runs the client's retry and response
callback layers, which together cost about as much as the loopback round trip itself. A forked child
never uses its parent's connection.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

from mrtr_keys.errors import ConfigError
from mrtr_keys.replay.store import KEY_BYTES, Health, redact

DEFAULT_PREFIX = "mrtr:replay:"
MAX_PREFIX_CHARS = 200


def _kernel_timeouts(timeout: float) -> Callable[[Any], None]:
    """A redis-py ``redis_connect_func`` that bounds every read and write with ``SO_RCVTIMEO`` /
    ``SO_SNDTIMEO`` (socket(7)) and then runs the usual connection handshake.

    With redis-py's own ``socket_timeout`` the socket is in Python's timeout mode, which polls before
    every send and receive: about 12 µs per command on this project's bench machine, a fifth of a
    loopback round trip. Kernel timeouts keep the socket blocking; a read that times out fails with
    ``EAGAIN``, which redis-py raises as a ``ConnectionError``.
    """
    seconds = int(timeout)
    value = struct.pack("ll", seconds, int((timeout - seconds) * 1_000_000))

    def connect(conn: Any) -> None:
        sock = conn._sock  # set by redis-py just before it calls this function
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        conn.on_connect()

    return connect


class RedisReplayStore:
    """A `ReplayStore` on Redis (redis-py, thread-safe connection pool).

    Args:
        url: ``redis://[[USER]:PASSWORD@]HOST:PORT/DB[?prefix=TEXT]`` (``rediss://`` for TLS).
        timeout: seconds to connect or to get an answer.

    Raises:
        ConfigError: the ``redis`` extra is missing, or the URL cannot be parsed.
    """

    def __init__(self, url: str, *, timeout: float) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ConfigError("the redis replay store needs redis-py: pip install 'mrtr-keys[redis]'") from None
        parsed = urlparse(url)
        query = parse_qsl(parsed.query, keep_blank_values=True)
        prefix = DEFAULT_PREFIX
        rest = []
        for name, value in query:
            if name == "prefix":
                prefix = value
            else:
                rest.append((name, value))
        if not 0 < len(prefix) <= MAX_PREFIX_CHARS:
            raise ConfigError(f"the redis replay store prefix must be 1-{MAX_PREFIX_CHARS} characters")
        self.url = redact(url)
        self.prefix = prefix
        self._prefix = prefix.encode("utf-8")
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        timeouts: dict[str, Any] = {"socket_timeout": timeout}
        if parsed.scheme == "redis":  # plain TCP: the kernel times reads and writes out (see `_kernel_timeouts`)
            timeouts = {"socket_timeout": None, "redis_connect_func": _kernel_timeouts(timeout)}
        try:
            self._client: Any = redis.Redis.from_url(
                urlunparse(parsed._replace(query=urlencode(rest))),
                socket_connect_timeout=timeout,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
                **timeouts,
            )
        except ValueError as exc:
            raise ConfigError(f"bad redis replay store URL {self.url}: {exc}") from None
        self._health = Health(self.url)
        self._key: bytes | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._held: list[tuple[threading.Thread, Any]] = []
        """(thread, its connection) of every live thread that has one."""

    def __repr__(self) -> str:
        return f"RedisReplayStore({self.url!r}, prefix={self.prefix!r})"

    @property
    def healthy(self) -> bool:
        return self._health.healthy

    @property
    def down_since(self) -> float | None:
        """POSIX time since which calls fail (None while they succeed)."""
        return self._health.down_since

    def _connection(self) -> Any:
        """This thread's connection (made on first use in this thread and process). Making one closes those of
        threads that have ended: a sidecar's worker threads come and go, and each kept its connection (and a
        Redis client) to the end."""
        held = getattr(self._local, "held", None)
        pid = os.getpid()
        if held is not None and held[0] == pid:
            return held[1]
        # Made from the pool's class and settings, not by `make_connection`: the pool counts every connection it
        # makes against its max_connections (100 by default since redis-py 8) and forgets none it did not hand
        # out itself, so the 101st thread of a sidecar's life got MaxConnectionsError (HTTP 500 on every unseal
        # from then on, issue 40's 60-minute run) though the connections of ended threads are closed below.
        pool = self._client.connection_pool
        conn = pool.connection_class(**pool.connection_kwargs)
        with self._lock:
            ended = [c for t, c in self._held if not t.is_alive()]
            self._held = [(t, c) for t, c in self._held if t.is_alive()]
            self._held.append((threading.current_thread(), conn))
        for old in ended:
            old.disconnect()
        self._local.held = (pid, conn)
        return conn

    def consume(self, token_id: bytes, ttl_ms: int) -> bool:
        """``SET PREFIX+hex(id) 1 NX PX ttl_ms``: True if this call created the record.

        Raises:
            ReplayStoreUnavailable: Redis unreachable, timed out, or answered an error.
        """
        try:
            conn = self._connection()
            conn.send_command("SET", self._prefix + token_id.hex().encode("ascii"), b"1", "NX", "PX", ttl_ms)
            reply = conn.read_response()
        except self._errors as exc:
            held = getattr(self._local, "held", None)
            if held is not None:
                held[1].disconnect()
            raise self._health.failed(exc) from None
        self._health.ok()
        return reply is not None

    def hmac_key(self) -> bytes:
        """The fleet's HMAC key: ``SET PREFIX+"hmac-key" <32 random bytes> NX`` then ``GET`` (cached).

        Raises:
            ReplayStoreUnavailable: Redis unreachable, or the stored key is not 32 bytes.
        """
        key = self._key
        if key is not None:
            return key
        name = self._prefix + b"hmac-key"
        try:
            self._client.set(name, os.urandom(KEY_BYTES), nx=True)
            stored = self._client.get(name)
        except self._errors as exc:
            raise self._health.failed(exc) from None
        if not isinstance(stored, bytes) or len(stored) != KEY_BYTES:
            raise self._health.failed(ValueError("bad hmac-key record"))
        self._health.ok()
        self._key = stored
        return stored

    def ping(self) -> bool:
        try:
            self._client.ping()
        except self._errors as exc:
            self._health.failed(exc)
            return False
        self._health.ok()
        return True

    def clear(self) -> int:
        """Delete every record under this store's prefix (tests and ``flush`` tooling); returns the count."""
        count = 0
        for key in self._client.scan_iter(match=self._prefix + b"*", count=1000):
            count += int(self._client.delete(key))
        self._key = None
        return count

    def close(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        for _, conn in held:
            conn.disconnect()
        self._client.close()
