"""Part: single-use unseal (docs/single-use.md) against its anchors, on the local Redis and PostgreSQL.

Per store, three loops run interleaved (wall clock: they wait on a server):

* ``plain unseal``: the local codec's unseal of a 300-byte envelope (no store);
* ``single-use unseal``: the same codec wrapped by `request_state_security(single_use=URL)`, a fresh
  token per call (sealed before the timed loop), so every call is a first use that writes a record;
* the raw round trip the store is built on, with redis-py / psycopg and nothing else: ``SET key 1 NX PX``
  to the same Redis (``client.set``, the target's anchor; and, for context, the leaner form the store
  itself uses: a held connection with ``send_command`` / ``read_response``), ``INSERT ... ON CONFLICT DO
  NOTHING`` into a table of the same shape.

Rounds: 15 of 1,000 calls per subject on Redis, of 500 on PostgreSQL (each insert commits durably).
Target: single-use unseal <= 1.2x the raw round trip measured in the same run. Redis keys
live under a random prefix in DB 14 and are deleted at the end; PostgreSQL runs in a throwaway database.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.common import Settings, envelope_payload
from bench.report import Row, spread_of
from bench.services import AUDIENCE, Services
from bench.timing import Loop, interleaved, median, paired_ratio

PART = "single_use"
REDIS_URL = os.environ.get("MRTR_KEYS_BENCH_REDIS", "redis://127.0.0.1:6379/14")
PG_ADMIN_URL = os.environ.get("MRTR_KEYS_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
TTL_MS = 660_000
HELD = "raw SET NX PX, held connection (redis-py send_command)"


@contextmanager
def _redis() -> Iterator[str]:
    import redis

    prefix = f"mrtr-bench-{uuid.uuid4().hex[:12]}:"
    try:
        yield f"{REDIS_URL}?prefix={prefix}"
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(key)
        client.close()


@contextmanager
def _postgres() -> Iterator[str]:
    import psycopg

    name = f"mrtr_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _raw_redis(url: str) -> Loop:
    import redis

    base, _, query = url.partition("?prefix=")
    client = redis.Redis.from_url(base)
    prefix = (query + "raw:").encode()

    def loop(n: int) -> None:
        keys = [prefix + os.urandom(16).hex().encode() for _ in range(n)]
        start = time.perf_counter()
        for key in keys:
            client.set(key, b"1", nx=True, px=TTL_MS)
        loop.spent += time.perf_counter() - start  # type: ignore[attr-defined]

    return loop


def _raw_redis_held(url: str) -> Loop:
    """The leanest redis-py form, as the store sends it: one held connection, `send_command` + `read_response`
    (no pool checkout, retry or response-callback layers per command)."""
    import redis

    base, _, query = url.partition("?prefix=")
    conn = redis.Redis.from_url(base).connection_pool.make_connection()
    prefix = (query + "held:").encode()

    def loop(n: int) -> None:
        keys = [prefix + os.urandom(16).hex().encode() for _ in range(n)]
        start = time.perf_counter()
        for key in keys:
            conn.send_command("SET", key, b"1", "NX", "PX", TTL_MS)
            conn.read_response()
        loop.spent += time.perf_counter() - start  # type: ignore[attr-defined]

    return loop


def _raw_postgres(url: str) -> Loop:
    import psycopg

    conn = psycopg.connect(url, autocommit=True)
    conn.execute("CREATE TABLE IF NOT EXISTS bench_raw (id bytea PRIMARY KEY, expires_at timestamptz NOT NULL)")
    conn.execute("CREATE INDEX IF NOT EXISTS bench_raw_expires ON bench_raw (expires_at)")
    sql = (
        "INSERT INTO bench_raw (id, expires_at) VALUES (%s, now() + %s * interval '1 millisecond') "
        "ON CONFLICT DO NOTHING"
    )

    def loop(n: int) -> None:
        ids = [os.urandom(16) for _ in range(n)]
        start = time.perf_counter()
        for token_id in ids:
            conn.execute(sql, (token_id, TTL_MS))
        loop.spent += time.perf_counter() - start  # type: ignore[attr-defined]

    return loop


def _unseal_fresh(codec: Any, payload: bytes) -> Loop:
    """Unseal `n` tokens sealed just before the timed part (each one a first use)."""

    def loop(n: int) -> None:
        tokens = [codec.seal(payload) for _ in range(n)]
        unseal = codec.unseal
        start = time.perf_counter()
        for token in tokens:
            unseal(token)
        loop.spent += time.perf_counter() - start  # type: ignore[attr-defined]

    return loop


def _timed(loops: dict[str, Loop], settings: Settings, *, per_round: int) -> dict[str, list[float]]:
    """Interleaved rounds where only each loop's own `spent` counts (token and key making excluded)."""
    inner = max(50, settings.inner // per_round)
    for loop in loops.values():
        loop.spent = 0.0  # type: ignore[attr-defined]

    def clock() -> float:
        return sum(loop.spent for loop in loops.values())  # type: ignore[attr-defined]

    return interleaved(loops, repeats=settings.repeats, inner=inner, clock=clock)


def run(services: Services, settings: Settings) -> list[Row]:
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.factory import request_state_security
    from mrtr_keys.keystores.file import FileKeystore

    path = services.workdir / "single-use-ring.json"
    if not path.exists():
        create_ring(FileKeystore(path))
    payload = envelope_payload()
    rows: list[Row] = []
    for store, opened, raw_name, raw_loop, per_round in (
        ("Redis", _redis, "raw SET NX PX (redis-py)", _raw_redis, 5),
        # a durable commit each (an fsync): fewer per round, or the part takes minutes
        ("PostgreSQL", _postgres, "raw INSERT ON CONFLICT DO NOTHING (psycopg)", _raw_postgres, 10),
    ):
        with opened() as url:
            plain = request_state_security(path, audience=AUDIENCE, audit=False).codec
            guarded = request_state_security(path, audience=AUDIENCE, audit=False, single_use=url).codec
            subject, anchor_plain = f"single-use unseal ({store})", f"plain unseal ({store} run)"
            loops = {anchor_plain: _unseal_fresh(plain, payload), raw_name: raw_loop(url)}
            if store == "Redis":
                loops[HELD] = _raw_redis_held(url)
            loops[subject] = _unseal_fresh(guarded, payload)
            r = _timed(loops, settings, per_round=per_round)
            guarded.close()
            rows.append(Row(PART, anchor_plain, "µs", median(r[anchor_plain]), spread_of(r[anchor_plain])))
            rows.append(Row(PART, raw_name, "µs", median(r[raw_name]), spread_of(r[raw_name])))
            vs_plain = Row(PART, f"{subject} vs plain", "µs", median(r[subject]), spread_of(r[subject]), anchor_plain)
            vs_plain.ratio = paired_ratio(r[subject], r[anchor_plain])
            rows.append(vs_plain)
            vs_raw = Row(PART, subject, "µs", median(r[subject]), spread_of(r[subject]), raw_name)
            vs_raw.ratio = paired_ratio(r[subject], r[raw_name])
            vs_raw.note = f"overhead over the raw round trip {median(r[subject]) - median(r[raw_name]):.1f} µs"
            rows.append(vs_raw.decide(vs_raw.ratio, "<= 1.2x"))
            if store == "Redis":
                rows.append(Row(PART, HELD, "µs", median(r[HELD]), spread_of(r[HELD])))
                vs_held = Row(PART, f"{subject} vs held", "µs", median(r[subject]), spread_of(r[subject]), HELD)
                vs_held.ratio = paired_ratio(r[subject], r[HELD])
                vs_held.note = "the store's own form of the call: the rest is unseal, claims parse, keyed hash"
                rows.append(vs_held)
    return rows
