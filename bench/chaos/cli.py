"""``python -m bench chaos --minutes M --seed S [--json] [--replay FILE]`` (also ``make bench BENCH_ARGS='chaos'``).

Starts its own OpenBao dev server (`bench.services`), a throwaway PostgreSQL database on the local server
(dropped at the end) and a Redis key prefix of its own (database 12, keys deleted at the end), runs the
fleet (`bench.chaos.run`), prints the schedule as it starts and a summary at the end (``--json``: the whole
report instead), writes ``bench/results/chaos-<UTC>.json`` and the schedule beside it, and exits 1 if any
invariant was violated (0 otherwise; 2 for a bad command line).
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

from bench.chaos.fleet import Deps
from bench.chaos.report import summary
from bench.chaos.run import Config, run
from bench.chaos.schedule import KINDS, Schedule
from bench.report import RESULTS_DIR

REDIS = "redis://127.0.0.1:6379/12"


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(prog="python -m bench chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="length of the run (default 60)")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.add_argument("--replay", type=Path, help="play this saved schedule (its seed, length and fleet)")
    parser.add_argument("--instances", type=int, default=5, help="fleet size, 3 or more (default 5)")
    parser.add_argument("--ttl", type=float, default=30.0, help="the ring's TTL in seconds (default 30)")
    parser.add_argument("--rate", type=float, default=5.0, help="faults a minute on average (default 5)")
    parser.add_argument("--longest", type=float, default=30.0, help="longest fault in seconds (default 30)")
    parser.add_argument(
        "--force-retire-after-ttl",
        action="store_true",
        help="force each retire once only the 60 s clock-skew allowance is left (runs shorter than TTL + 60 s)",
    )
    parser.add_argument("--warmup", type=float, default=300.0, help="seconds before resources are judged")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.instances < 3 or not args.minutes > 0 or not args.ttl > 0:
        parser.error("--instances must be 3 or more, --minutes and --ttl positive")
    replay = None
    if args.replay is not None:
        try:
            replay = Schedule.load(args.replay)
        except (OSError, ValueError) as exc:
            parser.error(f"--replay {args.replay}: {exc}")
    config = Config(
        seconds=replay.seconds if replay else args.minutes * 60,
        seed=replay.seed if replay else args.seed,
        instances=len(replay.instances) if replay else args.instances,
        ttl=args.ttl,
        rate=args.rate,
        force_after_ttl=args.force_retire_after_ttl,
        warmup=args.warmup,
        longest=args.longest,
        menu=replay.menu if replay else KINDS,
        replay=replay,
        results_dir=args.results_dir,
        quiet=args.json,
    )
    return args, config


def main(argv: list[str] | None = None) -> int:
    args, config = parse(argv)
    from tests.fixtures.postgres import PG_ADMIN_URL, _connect, _ensure_running

    from bench.services import Services

    _ensure_running()
    database = f"mrtr_chaos_{uuid.uuid4().hex[:10]}"
    prefix = f"mrtr-chaos-{uuid.uuid4().hex[:10]}:"
    with _connect(PG_ADMIN_URL) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    try:
        with Services() as services:
            bao = services.bao
            deps = Deps(bao.addr, "root", PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + database, f"{REDIS}?prefix={prefix}")
            doc = run(config, deps, Path(services.workdir) / "chaos")
    finally:
        with _connect(PG_ADMIN_URL) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        _forget_redis(prefix)
    print(json.dumps(doc, indent=1, default=str) if args.json else summary(doc))
    if doc.get("results") and not args.json:
        print(f"results: {doc['results']}", file=sys.stderr)
    return 1 if doc["violations"] else 0


def _forget_redis(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS)
    try:
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(key)
    finally:
        client.close()
