"""A fleet rotates under traffic with nothing rejected.

Six real processes share one key ring (TTL 10 s, so a loaded machine does not expire rounds) and one
PostgreSQL audit store: four MCP servers built with `mrtr_keys.request_state_security` and its default
auto-reload (one of them gets no traffic at all until the end), and two sidecars. A driver sends multi-round
flows continuously, each retry to another instance than the first round. A pipeline runs
``mrtr-keys rotate next --wait 900`` through the three phases twice; meanwhile one server is killed -9
(heartbeats every 5 s, so the first promote waits about 15 s for it to go stale) and one sidecar is
restarted. Asserted: 0 rejected rounds, 0 failed requests, the idle server serves after the second retire,
and from the audit log that each gated phase (promote, retire) began only after every live instance had
loaded the generation before it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.audit.events import parse_event_time
from tests.e2e.servers import ServerPool
from tests.e2e.traffic import Traffic
from tests.fixtures.common import run_cli
from tests.fixtures.sidecar import Sidecar, start_sidecar

pytestmark = pytest.mark.e2e

HEARTBEAT = "5"
TTL = "10"


class Fleet:
    """The processes, with when each was ready and when it stopped (POSIX times)."""

    def __init__(self, ring: Path, env: dict[str, str], tmp: Path) -> None:
        self.ring, self.env, self.tmp = ring, env, tmp
        self.pool = ServerPool(tmp / "servers", env=env)
        self.sidecars: dict[str, Sidecar] = {}
        self.lives: list[dict[str, Any]] = []  # name, pid, ready, end, killed

    def mcp(self, *names: str) -> dict[str, str]:
        servers = [
            self.pool.launch(keystore=self.ring, instance=n, extra_args=("--ttl", TTL, "--heartbeat-every", HEARTBEAT))
            for n in names
        ]
        self.pool.wait_ready()
        for s in servers:
            self.lives.append(
                {"name": s.instance, "pid": s.proc.pid, "ready": time.time(), "end": None, "proc": s.proc}
            )
        return {s.instance: s.url for s in servers}

    def sidecar(self, name: str) -> str:
        extra = ("--instance", name, "--heartbeat-interval", HEARTBEAT)
        s = start_sidecar(self.ring, workdir=self.tmp / name, reload_interval=2.0, extra=extra, env=self.env)
        self.sidecars[name] = s
        self.lives.append({"name": name, "pid": s.proc.pid, "ready": time.time(), "end": None, "proc": s.proc})
        return s.url

    def ended(self, pid: int, *, killed: bool = False) -> None:
        for life in self.lives:
            if life["pid"] == pid:
                life["end"], life["killed"] = time.time(), killed

    def close(self) -> None:
        self.pool.close()
        for s in self.sidecars.values():
            s.stop()


def _events(op: str, env: dict[str, str], ring: Path) -> list[dict[str, Any]]:
    res = run_cli("audit", "query", "--op", op, "--json", keystore=ring, env=env)
    assert res.code == 0, res.err
    events: list[dict[str, Any]] = res.json()
    return events


def test_a_fleet_rotates_twice_under_traffic_with_nothing_rejected(tmp_path: Path, postgres_url: str) -> None:
    ring = tmp_path / "ring" / "keyring.json"
    env = {"MRTR_KEYS_AUDIT": postgres_url, "MRTR_KEYS_KEYSTORE": str(ring)}
    assert run_cli("init", "--ttl", TTL, keystore=ring, env=env).code == 0
    secret = run_cli("clients", "add", "driver", "--audience", "provisioner", "--json", keystore=ring, env=env)
    assert secret.code == 0, secret.err
    fleet = Fleet(ring, env, tmp_path)
    traffic: Traffic | None = None
    try:
        mcp = fleet.mcp("mcp-1", "mcp-2", "mcp-3", "mcp-idle")
        sidecars = {name: fleet.sidecar(name) for name in ("sc-1", "sc-2")}
        traffic = Traffic(mcp, sidecars, secret.json()["secret"])
        for name in ("mcp-1", "mcp-2", "mcp-3", "sc-1", "sc-2"):  # mcp-idle: no traffic at all, yet
            traffic.put_in(name)
        traffic.start()
        traffic.wait_rounds(6)

        steps: list[dict[str, Any]] = []

        def step(*, settle: bool = True) -> dict[str, Any]:
            started = time.monotonic()
            res = run_cli("rotate", "next", "--wait", "900", "--json", keystore=ring, env=env, timeout=240)
            assert res.code == 0, res.err + res.out
            doc = {**res.json(), "seconds": time.monotonic() - started, "waited": "waiting to " in res.err}
            steps.append(doc)
            if settle:
                traffic.wait_rounds(2)  # traffic flows between phases too
            return doc

        for rotation in (1, 2):
            if rotation == 1:  # a crash: it never loads phase 1; the gates count it until its heartbeat is stale
                victim = fleet.pool.servers[2]
                traffic.take_out("mcp-3")
                victim.proc.kill()
                victim.proc.wait(10)
                fleet.ended(victim.proc.pid, killed=True)
            assert step(settle=False)["step"] == "begin"
            assert step()["step"] == "promote"
            if rotation == 1:  # a clean restart under the same name
                traffic.take_out("sc-2")
                old = fleet.sidecars.pop("sc-2")
                old.stop()
                fleet.ended(old.proc.pid)
                sidecars["sc-2"] = fleet.sidecar("sc-2")
                traffic.sidecars["sc-2"] = sidecars["sc-2"]
                traffic.put_in("sc-2")
                traffic.wait_rounds(3, involving="sc-2")
            assert step()["step"] == "retire"

        # the instance nobody talked to kept itself current: it seals and opens at the last generation
        traffic.put_in("mcp-idle")
        traffic.wait_rounds(4, involving="mcp-idle")
        traffic.stop()
        if traffic.rejected or traffic.failed:
            why = run_cli("audit", "query", "--outcome", "rejected", "--json", keystore=ring, env=env).out
            pytest.fail("\n".join([*traffic.log[:20], why[:3000]]))

        # the audit log: every gated phase began after every live instance had loaded the phase before it
        changes = {op: _events(op, env, ring) for op in ("begin", "promote", "retire")}
        loaded = _events("ring-loaded", env, ring)
        assert [len(changes[op]) for op in ("begin", "promote", "retire")] == [2, 2, 2]
        assert all(e["reason"] is None for op in changes for e in changes[op])  # nothing forced
        checked = 0
        for gated, before in (("promote", "begin"), ("retire", "promote")):
            for change, prior in zip(changes[gated], changes[before], strict=True):
                at = parse_event_time(change["time"]).timestamp()
                target = prior["generation"]
                for life in fleet.lives:
                    alive = life["ready"] <= at and (life["end"] is None or at < life["end"])
                    if not alive:
                        continue
                    mine = [e for e in loaded if f":{life['pid']}:" in e["instance"] and e["generation"] >= target]
                    assert mine and min(parse_event_time(e["time"]).timestamp() for e in mine) <= at, (
                        gated,
                        life["name"],
                        target,
                    )
                    checked += 1
        viewed = run_cli("fleet", "status", "--json", keystore=ring, env=env)
        assert viewed.code == 0, viewed.err + viewed.out
        fleet_view = viewed.json()
        status = {r["name"]: (r["status"], r["generation"]) for r in fleet_view}
        final = changes["retire"][-1]["generation"]
        assert status["mcp-3"][0] == "stale" and status["sc-2"] == ("live", final)
        assert all(status[n] == ("live", final) for n in ("mcp-1", "mcp-2", "mcp-idle", "sc-1"))
        summary = {
            "rounds": traffic.rounds,
            "rejected": traffic.rejected,
            "failed": traffic.failed,
            "phases": len(steps),
            "waits": sum(s["waited"] for s in steps),
            "step_seconds": [round(s["seconds"], 1) for s in steps],
            "gate_checks": checked,
            "by_instance": traffic.by_instance,
        }
        (tmp_path / "fleet-summary.json").write_text(json.dumps(summary))
        print(f"\nfleet under traffic: {json.dumps(summary)}")
        if os.environ.get("MRTR_KEYS_FLEET_SUMMARY"):
            Path(os.environ["MRTR_KEYS_FLEET_SUMMARY"]).write_text(json.dumps(summary))
        assert summary["waits"] >= 3 and checked >= 10
    finally:
        if traffic is not None:
            traffic.stop()
        fleet.close()
