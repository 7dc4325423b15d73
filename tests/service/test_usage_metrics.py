"""The sidecar's seal counts (issue 36): ``mrtr_sidecar_seals_total{kid}`` and ``mrtr_sidecar_unseals_total{kid,
outcome}`` per kid of the loaded ring, ``unknown`` for any other kid (``/metrics`` needs no secret, so a forged kid
must not add a label), each usable key's use of its seal budget, and the same in an authenticated ``/readyz``.

In process (the app under Starlette's test client), without a presence store: the counts are this process's
(``scope`` ``process``); tests/e2e/test_usage_fleet.py runs sidecars over PostgreSQL.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from mrtr_keys.changes.create import create_ring
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.budgets import budget_of
from mrtr_keys.service.app import create_app
from mrtr_keys.service.clients import add_client
from mrtr_keys.service.config import ServiceConfig
from mrtr_keys.token import b64u_decode, b64u_encode


def _samples(client: TestClient, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = client.get("/metrics").text
    return {
        tuple(sorted(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name
    }


def test_per_kid_counts_label_only_the_rings_kids_and_readyz_reports_the_budget(tmp_path: Path) -> None:
    ring_path = tmp_path / "keyring.json"
    create_ring(FileKeystore(ring_path))
    ring = FileKeystore(ring_path).load()
    kid = ring.primary.kid
    _, secret = add_client(tmp_path / "clients.json", "web", audiences=["web"])
    app = create_app(ServiceConfig(), keystore=str(ring_path))
    client = TestClient(app)
    auth = {"authorization": f"Bearer {secret}"}
    payload = base64.urlsafe_b64encode(b"state").decode().rstrip("=")
    tokens = [client.post("/v1/seal", json={"audience": "web", "payload": payload}, headers=auth).json()["token"]]
    tokens += [client.post("/v1/seal", json={"audience": "web", "payload": payload}, headers=auth).json()["token"]]
    for t in tokens:
        assert client.post("/v1/unseal", json={"audience": "web", "token": t}, headers=auth).status_code == 200
    raw = b64u_decode(tokens[0][4:])
    tampered = tokens[0][:4] + b64u_encode(raw[:-1] + bytes([raw[-1] ^ 1]))
    forged = [tokens[0][:4] + b64u_encode(os.urandom(4) + raw[4:]) for _ in range(20)]  # 20 kids nobody has
    for t in [tampered, *forged]:
        assert client.post("/v1/unseal", json={"audience": "web", "token": t}, headers=auth).status_code == 400

    seals = _samples(client, "mrtr_sidecar_seals_total")
    unseals = _samples(client, "mrtr_sidecar_unseals_total")
    assert seals == {(("kid", kid),): 2.0}
    assert unseals == {
        (("kid", kid), ("outcome", "ok")): 2.0,
        (("kid", kid), ("outcome", "rejected")): 1.0,
        (("kid", "unknown"), ("outcome", "rejected")): 20.0,
    }
    budget = budget_of(ring, ring.primary)
    used = _samples(client, "mrtr_sidecar_key_budget_used_ratio")
    assert used == {(("kid", kid), ("state", "primary")): 2 / budget}
    assert _samples(client, "mrtr_sidecar_key_seal_budget") == {(("kid", kid), ("state", "primary")): float(budget)}

    ready = client.get("/readyz", headers=auth).json()
    assert ready["ready"] is True
    usage = ready["key_usage"]
    assert usage["scope"] == "process"  # no presence store: this process's counts (the readyz probe's seal too)
    (entry,) = usage["keys"]
    assert (entry["kid"], entry["state"], entry["format"], entry["budget"]) == (kid, "primary", "mk2", 2**47)
    assert entry["seals"] == 3 and "note" not in entry
    assert "key_usage" not in client.get("/readyz").json()  # only for an authenticated caller


def test_the_budget_alerts_fire_at_half_and_past_the_budget_on_the_metrics_a_sidecar_exports(tmp_path: Path) -> None:
    """deploy/prometheus/alerts.yaml, evaluated on this sidecar's /metrics (tests/support/promql.py): the
    warning from 50 % of the primary's budget, the critical alert from 100 %; sealing never stops."""
    from dataclasses import replace

    import yaml

    from tests.support.promql import firing

    ring_path = tmp_path / "keyring.json"
    store = FileKeystore(ring_path)
    create_ring(store)
    ring = store.load()
    store.save(replace(ring.next_generation(), seal_budget=10), expected_generation=ring.generation)
    kid = ring.primary.kid
    _, secret = add_client(tmp_path / "clients.json", "web", audiences=["web"])
    client = TestClient(create_app(ServiceConfig(), keystore=str(ring_path)))
    auth = {"authorization": f"Bearer {secret}"}
    rules = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy/prometheus/alerts.yaml").read_text())
    exprs = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    half, spent = exprs["MrtrKeysSealBudgetHalfUsed"], exprs["MrtrKeysSealBudgetSpent"]

    def seal(n: int) -> None:
        items = [{"audience": "web", "payload": "eA"}] * n
        assert client.post("/v1/seal/batch", json={"items": items}, headers=auth).status_code == 200

    seal(4)
    text = client.get("/metrics").text
    assert firing(half, text) == {} and firing(spent, text) == {}
    seal(1)
    text = client.get("/metrics").text
    assert firing(half, text) == {(kid,): 0.5} and firing(spent, text) == {}
    seal(6)  # past it: still sealing
    text = client.get("/metrics").text
    assert firing(half, text) == {(kid,): 1.1} and firing(spent, text) == {(kid,): 1.1}
    entry = client.get("/readyz", headers=auth).json()["key_usage"]["keys"][0]
    # 12: readyz's own self-test sealed once more (a seal under the key like any other)
    assert entry["note"].startswith(f"key {kid} has used 12 of its seal budget of 10 (120 %) fleet-wide: past its")
