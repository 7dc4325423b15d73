"""The consume-once stores (Redis `SET NX PX`, PostgreSQL `INSERT ... ON CONFLICT DO NOTHING`) against the
real local servers: first writer wins, records expire with their token, the fleet shares one HMAC key,
an outage is an error that ends by itself when the store is back (docs/single-use.md)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import pytest

from mrtr_keys import replay
from mrtr_keys.errors import ConfigError, ReplayStoreUnavailable
from mrtr_keys.replay.store import KEY_BYTES
from tests.support.net import closed_by_peer, silent_server
from tests.support.proxy import CountingProxy


def test_the_first_consume_of_an_id_wins_and_every_later_one_loses(replay_url: str) -> None:
    a, b = replay.open_store(replay_url), replay.open_store(replay_url)  # two instances of a fleet
    try:
        token_id, other = os.urandom(16), os.urandom(16)
        assert a.consume(token_id, 60_000) is True
        assert a.consume(token_id, 60_000) is False
        assert b.consume(token_id, 60_000) is False
        assert b.consume(other, 60_000) is True
    finally:
        a.close()
        b.close()


def test_the_fleet_shares_one_hmac_key_created_on_first_use(replay_url: str) -> None:
    a, b = replay.open_store(replay_url), replay.open_store(replay_url)
    try:
        key = a.hmac_key()
        assert len(key) == KEY_BYTES and key == b.hmac_key() and key == replay.open_store(replay_url).hmac_key()
    finally:
        a.close()
        b.close()


def test_a_record_lives_as_long_as_asked(redis_replay_url: str, pg_replay_url: str) -> None:
    import psycopg
    import redis

    rs = replay.open_store(redis_replay_url)
    token_id = os.urandom(16)
    assert rs.consume(token_id, 90_000)
    client = redis.Redis.from_url(redis_replay_url.split("?")[0])
    prefix = redis_replay_url.split("prefix=")[1]
    assert 0 < client.pttl(prefix + token_id.hex()) <= 90_000
    rs.close()
    ps = replay.open_store(pg_replay_url)
    assert ps.consume(token_id, 90_000)
    with psycopg.connect(pg_replay_url) as conn:
        row = conn.execute("SELECT extract(epoch FROM expires_at - now()) FROM mrtr_replay_tokens").fetchone()
    assert row is not None and 0 < float(row[0]) <= 90
    ps.close()


def test_an_outage_raises_and_the_same_store_object_recovers(
    store_proxy: tuple[str, CountingProxy], caplog: pytest.LogCaptureFixture
) -> None:
    url, proxy = store_proxy
    store = replay.open_store(url)
    try:
        assert store.consume(os.urandom(16), 60_000)
        proxy.stop()
        caplog.set_level(logging.WARNING, logger="mrtr_keys.replay")
        for _ in range(3):
            with pytest.raises(ReplayStoreUnavailable) as info:
                store.consume(os.urandom(16), 60_000)
            assert "unreachable" in str(info.value)
        assert store.ping() is False
        proxy.start()
        assert store.consume(os.urandom(16), 60_000) is True
        assert store.ping() is True
        lines = [r.getMessage() for r in caplog.records if r.name == "mrtr_keys.replay"]
        assert len(lines) == 2, lines  # one line when it went away, one when it came back
        assert "unreachable" in lines[0] and "reachable again" in lines[1]
    finally:
        store.close()


def test_store_urls_are_checked_when_opened() -> None:
    for bad in ("", "memcached://127.0.0.1:11211", "redis://127.0.0.1:6379/0?prefix="):
        with pytest.raises(ConfigError):
            replay.open_store(bad)
    secret = replay.open_store("redis://:hunter2@127.0.0.1:6379/0")
    assert "hunter2" not in repr(secret) and "hunter2" not in secret.url


def _expired_rows(url: str, n: int, live: int = 0) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO mrtr_replay_tokens (id, expires_at) "
            "SELECT gen_random_bytes(16), now() - interval '1 minute' FROM generate_series(1, %s)",
            (n,),
        )
        conn.execute(
            "INSERT INTO mrtr_replay_tokens (id, expires_at) "
            "SELECT gen_random_bytes(16), now() + interval '1 hour' FROM generate_series(1, %s)",
            (live,),
        )


def _count(url: str) -> int:
    import psycopg

    with psycopg.connect(url) as conn:
        row: Any = conn.execute("SELECT count(*) FROM mrtr_replay_tokens").fetchone()
    return int(row[0])


def test_postgres_creates_its_table_on_first_use_and_purges_in_bounded_batches(
    pg_replay_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psycopg

    from mrtr_keys.replay import postgres_store

    with psycopg.connect(pg_replay_url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgcrypto")
    store = replay.open_store(pg_replay_url)
    try:
        assert store.consume(os.urandom(16), 60_000)  # creates the schema
        _expired_rows(pg_replay_url, 250, live=3)
        monkeypatch.setattr(postgres_store, "PURGE_BATCH", 100)
        monkeypatch.setattr(postgres_store, "PURGE_MAX_BATCHES", 2)
        assert store.purge_once() == 200  # type: ignore[attr-defined]  # bounded: 2 batches of 100
        assert store.purge_once() == 50  # type: ignore[attr-defined]
        assert _count(pg_replay_url) == 4  # the live rows stay
    finally:
        store.close()


def test_the_postgres_purge_loop_recovers_after_an_outage(pg_replay_url: str) -> None:
    import time

    import psycopg

    from mrtr_keys.replay.postgres_store import PostgresReplayStore
    from tests.fixtures.faults import proxied
    from tests.support.waiting import until

    with psycopg.connect(pg_replay_url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgcrypto")
    with proxied(pg_replay_url) as (proxy, url):
        store = PostgresReplayStore(url, timeout=1.0, purge_interval=0.05)
        try:
            assert store.consume(os.urandom(16), 60_000)  # schema, and the purge thread starts
            proxy.stop()
            _expired_rows(pg_replay_url, 30)
            time.sleep(0.3)  # a few purge passes fail while the store is away
            assert _count(pg_replay_url) == 31
            proxy.start()
            until(lambda: _count(pg_replay_url) == 1, 20, "only the live record is left", every=0.05)
        finally:
            store.close()


def test_a_redis_that_accepts_but_never_answers_is_an_outage_not_a_hang() -> None:
    """Reads are bounded by the kernel (SO_RCVTIMEO) on plain TCP, by redis-py's timeout on TLS: either way
    a silent server is `ReplayStoreUnavailable`, never a blocked caller (pytest-timeout guards the test)."""
    from mrtr_keys.replay.redis_store import RedisReplayStore

    with silent_server() as (port, _):
        store = RedisReplayStore(f"redis://127.0.0.1:{port}/0", timeout=0.2)
        try:
            with pytest.raises(ReplayStoreUnavailable):
                store.consume(os.urandom(16), 60_000)
            assert store.ping() is False
        finally:
            store.close()


def test_a_postgres_connect_that_timed_out_leaves_no_socket_open() -> None:
    """Each attempt that gives up (libpq's 2 s ``connect_timeout``) closes its socket at once, not when a
    garbage collection happens to run: after a silent spell, held-open attempts would otherwise all reach the
    server when the network heals (seen: 100-250 PostgreSQL backends at once)."""
    import gc

    from mrtr_keys.replay.postgres_store import PostgresReplayStore

    with silent_server() as (port, held):
        store = PostgresReplayStore(f"postgresql://u@127.0.0.1:{port}/db", timeout=0.3)
        gc.disable()  # what is asserted must not depend on when a collection runs
        try:
            for _ in range(3):
                with pytest.raises(ReplayStoreUnavailable):
                    store.consume(os.urandom(16), 60_000)
            time.sleep(2.5)  # past libpq's connect_timeout (2 s) for every attempt
            assert len(held) == 3 and all(closed_by_peer(s) for s in held)
        finally:
            gc.enable()
            store.close()


def _sockets_to(port: int) -> int:
    """This process's open TCP sockets whose remote port is `port` (from /proc: what the kernel holds)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/self/net/{table}").read().splitlines()[1:]:
            cols = line.split()
            if int(cols[2].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += target.startswith("socket:[") and target[8:-1] in inodes
    return count


def test_a_redis_store_closes_the_connection_of_a_thread_that_ended(redis_replay_url: str) -> None:
    """Each thread keeps its own connection; one of a thread that has ended is closed when a new thread makes
    its own. They were all kept to the end: a sidecar, whose worker threads come and go, held 85 connections to
    Redis after ten minutes of issue 40's chaos run (5 after its warm-up), one more each new worker thread."""
    store = replay.open_store(redis_replay_url)
    port = int(redis_replay_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    try:
        before = _sockets_to(port)
        for _ in range(20):
            worker = threading.Thread(target=store.consume, args=(os.urandom(16), 60_000))
            worker.start()
            worker.join()
        last = threading.Thread(target=store.consume, args=(os.urandom(16), 60_000))
        last.start()
        last.join()
        assert _sockets_to(port) - before <= 2, "connections of ended threads are still open"
    finally:
        store.close()
    assert _sockets_to(port) == before


def test_a_redis_store_serves_any_number_of_threads_over_its_life(redis_replay_url: str) -> None:
    """A sidecar's worker threads come and go for as long as it runs. Each new thread's connection was made by
    the redis-py pool, which counts every connection it makes against max_connections (100 since redis-py 8)
    and never learnt that those of ended threads were closed: the 101st thread's consume raised
    MaxConnectionsError, not even ReplayStoreUnavailable, and the sidecar answered HTTP 500 to every unseal
    from then on (issue 40's 60-minute chaos run, 1,473 failed requests on one sidecar)."""
    store = replay.open_store(redis_replay_url)
    port = int(redis_replay_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    results: list[object] = []

    def consume() -> None:
        try:
            results.append(store.consume(os.urandom(16), 60_000))
        except Exception as exc:  # the assertion below names it
            results.append(exc)

    try:
        before = _sockets_to(port)
        for _ in range(150):
            worker = threading.Thread(target=consume)
            worker.start()
            worker.join()
        assert results == [True] * 150, [r for r in results if r is not True][:1]
        assert _sockets_to(port) - before <= 2
    finally:
        store.close()
