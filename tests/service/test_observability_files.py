"""The Grafana dashboard and the Prometheus alerts name only metrics a running sidecar exports, and the
sidecar logs one JSON object a line with ``--log-format json`` (deliverable 2).

One real sidecar (``mrtr-keys serve``): started with no clients (its WARNING is checked as JSON),
then a client, a seal, an unseal and a refused token, then ``GET /metrics``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mrtr_keys.changes.create import create_ring
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.keystores.file import FileKeystore

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "mrtr-keys.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
METRIC = re.compile(r"\b(mrtr_[a-z_]+)\b")


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in doc["templating"]["list"] if v.get("type") == "query"]
    return exprs


def alert_exprs() -> dict[str, str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def test_dashboard_and_alerts_name_only_exported_metrics(tmp_path: Path, sidecar_factory: Any) -> None:
    ring = tmp_path / "ring" / "keyring.json"
    create_ring(FileKeystore(ring))
    sidecar = sidecar_factory(ring, extra=["--log-format", "json", "--audit-anchor", f"{tmp_path}/anchors/"])

    # JSON logs: every line an object; the zero-clients WARNING among them.
    lines = [json.loads(line) for line in sidecar.output().splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message", "pid"} <= set(line) for line in lines), lines
    (warning,) = [line for line in lines if line["level"] == "WARNING"]
    assert warning["logger"] == "mrtr_keys.service" and "mrtr-keys clients add NAME" in warning["message"]

    secret = sidecar.add_client("web", ["web"])
    http = sidecar.http(secret)
    token = http.post("/v1/seal", json={"audience": "web", "payload": "eA"}).json()["token"]
    assert http.post("/v1/unseal", json={"audience": "web", "token": token}).status_code == 200
    other = tmp_path / "other" / "keyring.json"
    create_ring(FileKeystore(other))
    foreign = LocalAESGCMCodec(other, audience="web").seal(b"x")
    assert http.post("/v1/unseal", json={"audience": "web", "token": foreign}).status_code == 400

    text = http.get("/metrics").text
    families = list(text_string_to_metric_families(text))
    samples = {s.name: s for f in families for s in f.samples}
    assert samples["mrtr_sidecar_ring_generation"].value == 1
    assert samples["mrtr_sidecar_ring_phase"].value == 0
    assert samples["mrtr_sidecar_build_info"].labels == {"version": "0.2.0"}
    rejected = [s for f in families for s in f.samples if s.name == "mrtr_sidecar_rejections_total"]
    assert [(s.labels, s.value) for s in rejected] == [({"reason": "unknown kid"}, 1.0)]

    named = {"dashboard": dashboard_exprs(), **{f"alert {k}": [v] for k, v in alert_exprs().items()}}
    assert set(alert_exprs()) == {
        "MrtrKeysInstanceBehind",
        "MrtrKeysRejectionSpike",
        "MrtrKeysAuditEventsDropped",
        "MrtrKeysAuditAnchorFailing",
        "MrtrKeysKeystoreUnreachable",
        "MrtrKeysWrappingKeyRevoked",
        "MrtrKeysWrappingKeyUnreachable",
        "MrtrKeysSealBudgetHalfUsed",
        "MrtrKeysSealBudgetSpent",
    }
    for where, exprs in named.items():
        for expr in exprs:
            names = METRIC.findall(expr)
            assert names, (where, expr)
            missing = [n for n in names if n not in samples]
            assert not missing, f"{where} names {missing}, not exported by /metrics"
