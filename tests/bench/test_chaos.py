"""A fixed-seed chaos run in `make test` (issue 40, docs/reliability.md): 45 s of overlapping faults, no violation.

The soak's own harness (`bench.chaos.run`) on a shorter fleet: two library MCP servers and one sidecar on an
OpenBao KV v2 ring (TTL 10 s, each retire forced once only the 60 s clock-skew allowance is left), presence and
audit in PostgreSQL, single-use rounds in Redis, every link behind its own fault proxy, the TypeScript servers
and client where ``node`` is on PATH, every instance anchoring its audit heads every 5 s. Seed 986 draws
nineteen faults of all twelve kinds of the menu: a kill, a pause, cuts, a blackhole, slow and flapping links,
killed audit writers, a full state directory (where this process may mount a tmpfs), ring writes racing the
rotator, a revoked key, a rotation begun by seal budget and a failing anchor destination. A seed fixes the
schedule, not the interleaving: the time-bounded invariants add what the host itself delayed
(`tests.support.lateness`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.chaos.fleet import Deps
from bench.chaos.report import summary
from bench.chaos.run import Config, run

from tests.fixtures.common import REPO
from tests.fixtures.openbao import OpenBao

SEED = 986


def test_a_45_s_chaos_run_of_three_instances_breaks_no_invariant(
    openbao: OpenBao, postgres_url: str, redis_replay_url: str, tmp_path: Path
) -> None:
    config = Config(
        seconds=45,
        seed=SEED,
        instances=3,
        ttl=10,
        rate=20,
        longest=10,
        force_after_ttl=True,
        spare=(),
        resource_every=5,
        after_heal=2,
        anchor_every=5,
        results_dir=tmp_path / "results",
    )
    doc = run(config, Deps(openbao.addr, openbao.token, postgres_url, redis_replay_url), tmp_path / "chaos")
    print("\n" + summary(doc))
    assert doc["violations"] == [], summary(doc)
    assert doc["faults_total"] >= 15  # a pause or a writer kill finds no process while it restarts: not applied
    assert {"kill", "cut", "blackhole", "flap", "revoke", "budget", "anchor_fail"} <= set(doc["faults"])
    assert doc["rounds"] >= 100 and doc["rotations"] >= 1
    assert doc["audit"]["verify_exit"] == 0 and doc["audit"]["expected"] > 0 and doc["anchors"] > 0
    assert doc["convergence"]["last_heal"] is not None


def test_the_command_refuses_a_bad_fleet_or_schedule_in_one_line(tmp_path: Path) -> None:
    """``python -m bench chaos`` (docs/reliability.md) checks its command line before it starts anything."""
    bad = tmp_path / "schedule.json"
    bad.write_text('{"seed": 1}')
    for args, says in (
        (["--instances", "2"], "--instances must be 3 or more"),
        (["--replay", str(bad)], "not a chaos schedule"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "bench", "chaos", *args], cwd=REPO, capture_output=True, text=True, check=False
        )
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
