"""A leaked key dies fleet-wide in seconds, under traffic (issue 37).

Five real instances share one key ring and a PostgreSQL audit store (presence included): three MCP servers
built with `mrtr_keys.request_state_security` and two sidecars, each checking the keystore at the default
interval (2 s, with jitter). A driver sends multi-round flows continuously, each retry to another instance,
holding every token `hold` seconds as a user answering a question would (`tests.e2e.traffic`). Then
``mrtr-keys keys revoke PRIMARY --yes --wait 30`` runs, as an operator would on a leak.

Asserted, from what the driver saw and from the audit log:

* every instance loaded the revocation within 3 s of the keystore showing it (its ``ring-loaded`` event
  against the ``revoke`` event, recorded right after the save; plus what the host delayed), and after that
  moment it neither opened nor sealed a token of the revoked kid;
* every refused round was refused as ``revoked kid``, nothing failed otherwise, and rounds on the new primary
  went on succeeding (none of its tokens refused);
* over Vault KV (the full run: many rounds in flight), the estimate ``keys revoke`` printed before it wrote is
  within 10 % of the rounds actually refused. The runs over a ring file and over Secrets Manager are shorter
  (tokens held 2 s) and report their counts.

Each run prints the per-instance times, and the full run also writes them to ``MRTR_KEYS_REVOKE_SUMMARY``
when set (the closing note's figures).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.audit.events import parse_event_time
from mrtr_keys.audit.writing.stores.base import Query
from mrtr_keys.audit.writing.stores.url import open_store
from tests.e2e.pauses import init_ring, start_mcp_servers, start_sidecar_instance
from tests.e2e.servers import ServerPool
from tests.e2e.traffic import Traffic
from tests.fixtures.common import run_cli
from tests.fixtures.moto_kms import AWS_ENV
from tests.fixtures.openbao import OpenBao
from tests.fixtures.sidecar import Sidecar
from tests.support.lateness import Relay

pytestmark = pytest.mark.e2e

TTL = "60"
HEARTBEAT = "5"
BOUND = 3.0
"""Seconds from the keystore showing the change to every instance refusing the kid (the issue's claim)."""


@pytest.fixture(params=["vault-kv", "file", "aws-sm"])
def fleet_ring(request: pytest.FixtureRequest, tmp_path: Path, postgres_url: str) -> tuple[str, dict[str, str], str]:
    """(the ring's location, the fleet's environment, the kind): presence and audit in PostgreSQL."""
    env = {"MRTR_KEYS_AUDIT": postgres_url, "MRTR_KEYS_STATE_DIR": str(tmp_path / "state")}
    if request.param == "vault-kv":
        bao: OpenBao = request.getfixturevalue("openbao")
        ring = f"vault-kv://secret/revoke/{tmp_path.name}"
        env.update(bao.env())
    elif request.param == "aws-sm":
        moto: str = request.getfixturevalue("moto_server")
        ring = f"aws-sm://revoke/{tmp_path.name}"
        env.update({**AWS_ENV, "AWS_ENDPOINT_URL": moto})
    else:
        ring = str(tmp_path / "ring" / "keyring.json")
    env["MRTR_KEYS_KEYSTORE"] = ring
    return ring, env, request.param


def _events(url: str) -> list[dict[str, Any]]:
    """Every event of the audit store at `url`, oldest first (the fields of ``audit query --json``)."""
    store: Any = open_store(url)
    try:
        return [r.event.to_json() for r in store.query(Query())]
    finally:
        store.close()


def _accounting(events: list[dict[str, Any]], revoked_at: float) -> dict[str, int]:
    """The revoked kid's rounds by fate, from its audit events (fingerprints): in flight when it was revoked
    (sealed before, not opened before), and of those refused, opened meanwhile by an instance that had not
    loaded the revocation yet, or never retried; and sealed after it by such an instance, then refused."""
    sealed: dict[str, float] = {}
    opened: dict[str, float] = {}
    refused: set[str] = set()
    for e in events:
        fp, at = e["fingerprint"], parse_event_time(e["time"]).timestamp()
        if not fp:
            continue
        if e["op"] == "seal" and e["outcome"] == "ok":
            sealed[fp] = at
        elif e["op"] == "unseal" and e["outcome"] == "ok":
            opened.setdefault(fp, at)
        elif e["op"] == "unseal":
            refused.add(fp)
    inflight = {fp for fp, at in sealed.items() if at <= revoked_at and opened.get(fp, revoked_at + 1) > revoked_at}
    late = {fp for fp, at in sealed.items() if at > revoked_at}
    return {
        "in_flight_at_revoke": len(inflight),
        "in_flight_refused": len(inflight & refused),
        "in_flight_opened_by_a_lagging_instance": len({fp for fp in inflight if fp in opened}),
        "in_flight_never_retried": len({fp for fp in inflight if fp not in opened and fp not in refused}),
        "sealed_after_by_a_lagging_instance": len(late),
        "sealed_after_refused": len(late & refused),
    }


def test_a_revoked_primary_dies_on_every_instance_within_3_s_under_traffic(
    tmp_path: Path, fleet_ring: tuple[str, dict[str, str], str]
) -> None:
    ring, env, kind = fleet_ring
    full = kind == "vault-kv"
    hold = 20.0 if full else 2.0
    secret = init_ring(ring, env, ttl=TTL)
    old = run_cli("keys", "list", "--json", keystore=ring, env=env).json()["keys"][0]["kid"]
    pool = ServerPool(tmp_path / "servers", env=env)
    sidecars: dict[str, Sidecar] = {}
    traffic: Traffic | None = None
    try:
        servers = start_mcp_servers(pool, ring, "mcp-1", "mcp-2", "mcp-3", ttl=TTL, heartbeat=HEARTBEAT, reload="2")
        for name in ("sc-1", "sc-2"):  # the default check interval, as the MCP servers'
            sidecars[name] = start_sidecar_instance(ring, env, tmp_path, name, heartbeat=HEARTBEAT, reload=2.0)
        pids = {s.instance: s.proc.pid for s in servers} | {n: s.proc.pid for n, s in sidecars.items()}
        traffic = Traffic(
            {s.instance: s.url for s in servers},
            {n: s.url for n, s in sidecars.items()},
            secret,
            hold=hold,
            pace=0.5,
            sidecar_flows=6 if full else 2,
        )
        for name in pids:
            traffic.put_in(name)
        traffic.start()
        time.sleep(hold + 1.0)  # the pipeline is full: tokens of every age up to `hold` are in flight
        assert traffic.rejected == 0 and traffic.failed == 0, traffic.log[:10]
        with Relay() as relay:
            res = run_cli(
                "keys", "revoke", old, "--reason", "ring file in a backup", "--yes", "--wait", "30", "--json",
                keystore=ring, env=env, timeout=120,
            )  # fmt: skip
            assert res.code == 0, res.err + res.out
            doc = res.json()
            time.sleep(hold + BOUND + 1.0)  # every token sealed under the old kid has come back
        traffic.stop()
        assert doc["applied"]["done"] is True and doc["applied"]["live"] == 5, doc["applied"]
        new, generation, estimate = doc["new"], doc["generation"], doc["estimate"]["rounds"]

        events = _events(env["MRTR_KEYS_AUDIT"])
        revoked_at = next(parse_event_time(e["time"]).timestamp() for e in events if e["op"] == "revoke")
        loaded = {
            name: min(
                parse_event_time(e["time"]).timestamp()
                for e in events
                if e["op"] == "ring-loaded" and f":{pid}:" in e["instance"] and e["generation"] == generation
            )
            for name, pid in pids.items()
        }
        took = {name: at - revoked_at for name, at in loaded.items()}
        assert max(took.values()) <= BOUND + relay.overrun, (took, relay.overrun)

        # after loading it, no instance opened or sealed a token of the revoked kid
        of_old = [e for e in events if e["kid"] == old]
        for e in of_old:
            name = next((n for n, pid in pids.items() if f":{pid}:" in e["instance"]), None)
            if name is not None and e["op"] in ("seal", "unseal") and e["outcome"] == "ok":
                assert parse_event_time(e["time"]).timestamp() <= loaded[name], (name, e)
        rejected = [e for e in events if e["outcome"] == "rejected"]
        assert {e["reason"] for e in rejected} <= {"revoked kid"} and {e["kid"] for e in rejected} <= {old}
        assert traffic.failed == 0, traffic.log[:10]
        assert not [e for e in rejected if e["kid"] == new]  # rounds on the new primary all succeeded
        refused = traffic.rejected
        summary = {
            **_accounting(of_old, revoked_at),
            "keystore": kind,
            "instances": {n: round(t, 3) for n, t in sorted(took.items())},
            "p50_s": round(statistics.median(took.values()), 3),
            "p99_s": round(max(took.values()), 3),  # 5 instances: p99 is the slowest
            "estimate": estimate,
            "refused": refused,
            "refused_audit": len(rejected),
            "rounds": traffic.rounds,
            "hold_s": hold,
            "host_lateness_s": round(relay.overrun, 3),
        }
        print(f"\nrevoke under traffic: {json.dumps(summary)}")
        if full:
            assert estimate >= 50, summary  # enough rounds in flight for a 10 % comparison to mean something
            assert abs(refused - estimate) <= 0.1 * estimate, summary
            if os.environ.get("MRTR_KEYS_REVOKE_SUMMARY"):
                Path(os.environ["MRTR_KEYS_REVOKE_SUMMARY"]).write_text(json.dumps(summary))
        else:
            assert estimate > 0 and refused > 0, summary
    finally:
        if traffic is not None:
            traffic.stop()
        pool.close()
        for s in sidecars.values():
            s.stop()
