"""A seal budget drives the rotation (issue 36): a ring with ``keys budget 4000`` under traffic through two
sidecars over one PostgreSQL presence store. ``rotate next --if-used-over 0.5`` does nothing below 2,000 seals
and begins above them, then promotes; the old key's count stops growing after the promote; no round is rejected;
and at 50 % the sidecars log their one WARNING, the alert rule's expression fires on their ``/metrics``
(tests/support/promql.py), and ``fleet status`` says so. The CLI transcript is printed (``-s``) for
docs/rotation.md.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mrtr_keys.audit.writing.stores.key_usage import totals
from mrtr_keys.audit.writing.stores.url import open_store
from tests.e2e.traffic import Traffic
from tests.fixtures.common import run_cli
from tests.fixtures.sidecar import start_sidecar
from tests.support import tls
from tests.support.promql import firing
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
HALF = {
    r["alert"]: r["expr"]
    for g in yaml.safe_load((REPO / "deploy/prometheus/alerts.yaml").read_text())["groups"]
    for r in g["rules"]
}["MrtrKeysSealBudgetHalfUsed"]


def test_a_seal_budget_begins_and_promotes_a_rotation_under_traffic(tmp_path: Path, postgres_url: str) -> None:
    ring = tmp_path / "ring" / "keyring.json"
    env = {"MRTR_KEYS_AUDIT": postgres_url, "MRTR_KEYS_KEYSTORE": str(ring)}
    transcript: list[str] = []

    def cli(*args: str, code: int = 0) -> Any:
        res = run_cli(*args, keystore=ring, env=env, timeout=120)
        assert res.code == code, res.err + res.out
        transcript.append(f"$ mrtr-keys {' '.join(args)}\n{res.out.strip()}")
        return res

    assert run_cli("init", "--ttl", "30", keystore=ring, env=env).code == 0
    cli("keys", "budget", "4000")
    secret = run_cli("clients", "add", "driver", "--audience", "provisioner", "--json", keystore=ring, env=env)
    assert secret.code == 0, secret.err
    token = secret.json()["secret"]
    ring_id = run_cli("keys", "list", "--json", keystore=ring, env=env).json()["ring_id"]
    old = run_cli("keys", "list", "--json", keystore=ring, env=env).json()["keys"][0]["kid"]
    sidecars: dict[str, Any] = {}
    traffic: Traffic | None = None
    try:
        for name in ("sc-1", "sc-2"):
            extra = ("--instance", name, "--heartbeat-interval", "1")
            sidecars[name] = start_sidecar(ring, workdir=tmp_path / name, reload_interval=0.5, extra=extra, env=env)
        traffic = Traffic({}, {n: s.url for n, s in sidecars.items()}, token, hold=0.2, pace=0.1)
        for name in sidecars:
            traffic.put_in(name)
        traffic.start()
        http = httpx.Client(base_url=sidecars["sc-1"].url, timeout=30, verify=tls.CONTEXT)
        payload = base64.urlsafe_b64encode(b"round state").decode().rstrip("=")

        def seal_batches(n: int) -> None:
            for _ in range(n):
                items = [{"audience": "provisioner", "payload": payload}] * 100
                r = http.post("/v1/seal/batch", json={"items": items}, headers={"authorization": f"Bearer {token}"})
                assert r.status_code == 200, r.text

        def fleet_seals(kid: str) -> int:
            store = open_store(postgres_url)
            try:
                t = totals(store.usage_rows(ring_id)).get(kid)
            finally:
                store.close()
            return 0 if t is None else t.seals

        seal_batches(15)  # 1,500 and some: under half of 4,000 even with every reservation (40 a block)
        assert fleet_seals(old) < 2000
        below = cli("rotate", "next", "--if-used-over", "0.5")
        assert below.out.startswith(f"nothing to do: primary {old} has used ") and "not over 50 %" in below.out
        assert run_cli("keys", "list", "--json", keystore=ring, env=env).json()["keys"][0]["state"] == "primary"

        seal_batches(6)  # past 2,000
        until(lambda: fleet_seals(old) > 2000, 20, "the fleet-wide count past half of the budget", every=0.2)

        # At 50 %: each sidecar's one WARNING, the alert on its metrics, and the fleet status line.
        def warned() -> bool:
            return all(f"key {old} has used" in s.output() for s in sidecars.values())

        until(warned, 20, "the 50 % warning in both sidecars' logs", every=0.2)
        assert all(s.output().count(f"key {old} has used") == 1 for s in sidecars.values())  # once, not per round
        until(lambda: firing(HALF, http.get("/metrics").text), 20, "MrtrKeysSealBudgetHalfUsed firing", every=0.2)
        assert list(firing(HALF, http.get("/metrics").text)) == [(old,)]
        status = cli("fleet", "status")
        assert (
            f"key {old} has used " in status.out and "rotate it: mrtr-keys rotate next --if-used-over 0.5" in status.out
        )

        begun = cli("rotate", "next", "--if-used-over", "0.5")
        assert begun.out.startswith("phase 1: ") and f"{old} still seals" in begun.out
        promoted = cli("rotate", "next", "--if-used-over", "0.5", "--wait", "120")  # in progress: it goes on
        assert promoted.out.startswith("phase 2: ") and f"{old} still verifies" in promoted.out
        for s in sidecars.values():
            s.wait_generation(token, 4, timeout=30)  # init 1, budget 2, begin 3, promote 4
        after_promote = fleet_seals(old)
        traffic.wait_rounds(10, timeout=60)
        seal_batches(3)  # the new key seals now
        assert fleet_seals(old) <= after_promote  # the old key's count stops growing (its reservation given back)
        traffic.stop()
        assert traffic.rounds > 0 and traffic.rejected == 0 and traffic.failed == 0, traffic.log[:20]
        cli("keys", "list")
        print("\n" + "\n".join(transcript))
    finally:
        if traffic is not None:
            traffic.stop()
        for s in sidecars.values():
            s.stop()
