"""The audit log after a sidecar run (a real ``mrtr-keys serve`` process), and strict mode."""

from __future__ import annotations

import base64
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.audit.capture.service_sink import SidecarAudit
from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.writing.fingerprint import Fingerprinter, load_audit_key
from mrtr_keys.service.app import create_app
from mrtr_keys.service.clients import add_client
from mrtr_keys.service.config import ServiceConfig
from tests.fixtures.audit import cli


def test_sidecar_records_every_request_with_client_kid_and_duration(
    keystore_path: Path, sidecar_factory: Callable[..., Any]
) -> None:
    _, secret = add_client(keystore_path.parent / "clients.json", "web", audiences=["svc"], ops=["seal", "unseal"])
    side = sidecar_factory(keystore_path)  # registry written first: no wait for its reload
    codec = side.codec("svc", secret)
    token = codec.seal(b"sidecar payload")
    assert codec.unseal(token) == b"sidecar payload"
    with pytest.raises(InvalidRequestState):
        codec.unseal(token[:-3] + "AAA")
    assert side.http("wrong-secret").post("/v1/seal", json={"audience": "svc", "payload": "AA"}).status_code == 401
    side.stop()  # the sidecar flushes its audit queue on exit

    res = cli("audit", "query", "--json", keystore=keystore_path)
    assert res.code == 0, res.err
    events = res.json()
    [loaded] = [e for e in events if e["op"] == "ring-loaded"]
    assert loaded["generation"] == 1
    fp = Fingerprinter(load_audit_key(keystore_path.parent)).fingerprint(token)
    mine = [e for e in events if e["fingerprint"] == fp]
    assert [(e["op"], e["outcome"], e["client"], e["audience"]) for e in mine] == [
        ("seal", "ok", "web", "svc"),
        ("unseal", "ok", "web", "svc"),
    ]
    assert all(e["instance"] == loaded["instance"] and e["kid"] == loaded["kid"] for e in mine)
    assert all(isinstance(e["duration_ms"], float) and e["duration_ms"] >= 0 for e in mine)
    rejected = [e for e in events if e["outcome"] == "rejected"]
    assert [(e["op"], e["reason"], e["client"]) for e in rejected] == [("unseal", "seal", "web")]
    assert any(e["outcome"] == "unauthorized" for e in events)
    stored = b"".join(p.read_bytes() for p in keystore_path.parent.glob("audit.db*"))
    for s in (token.encode(), b"sidecar payload", secret.encode(), base64.b64encode(b"sidecar payload")):
        assert s not in stored
    by_client = cli("audit", "stats", "--by", "client", "--json", keystore=keystore_path).json()
    assert {"key": "web", "count": 3} in by_client


def test_strict_mode_refuses_and_readyz_fails_while_the_store_cannot_be_written(
    keystore_path: Path, tmp_path: Path
) -> None:
    db = tmp_path / "strict.db"
    from mrtr_keys.audit.writing.stores.url import open_store

    store = open_store(f"sqlite://{db}")
    store._conn.execute("PRAGMA busy_timeout = 0")  # type: ignore[attr-defined]
    sink = AuditSink(store, Fingerprinter(load_audit_key(tmp_path)), interval=0.01)
    audit = SidecarAudit(sink, strict=True)
    _, secret = add_client(keystore_path.parent / "clients.json", "web", audiences=["svc"], ops=["seal", "unseal"])
    app = create_app(ServiceConfig(strict_audit=True), keystore=str(keystore_path), audit=audit)
    http = TestClient(app)  # in-process; the lifespan (reload loop) is not needed here
    auth = {"authorization": f"Bearer {secret}"}
    try:
        assert http.get("/readyz").status_code == 200
        assert http.post("/v1/seal", json={"audience": "svc", "payload": "AA"}, headers=auth).status_code == 200
        stall = sqlite3.connect(db, timeout=0)
        stall.execute("BEGIN EXCLUSIVE")  # the audit store can no longer be written
        sink.record("seal", kid="aaaaaaaa")
        sink.flush(timeout=5)
        ready = http.get("/readyz")
        assert ready.status_code == 503 and "audit store" in ready.json()["reason"]
        refused = http.post("/v1/seal", json={"audience": "svc", "payload": "AA"}, headers=auth)
        assert refused.status_code == 503 and refused.json() == {"error": "audit_unavailable"}
        stall.rollback()
        stall.close()
        assert sink.flush(timeout=10) and sink.healthy
        assert http.get("/readyz").status_code == 200
        assert http.post("/v1/seal", json={"audience": "svc", "payload": "AA"}, headers=auth).status_code == 200
    finally:
        http.close()
        sink.close()


def test_root_audit_option_reaches_every_sidecar_worker(
    keystore_path: Path, tmp_path: Path, sidecar_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mrtr-keys --audit URL serve --workers 2``: the store is passed to the workers in their settings
    (not through the environment), so their seals land in URL and nothing in the default audit.db."""
    import sys

    from tests.fixtures import sidecar as sidecar_fixture

    log = tmp_path / "sidecar-audit.jsonl"
    url = f"jsonl://{log}"
    cmd = [sys.executable, "-m", "mrtr_keys.cli.main", "--audit", url, "serve"]
    monkeypatch.setattr(sidecar_fixture, "SERVE", cmd)  # the root option goes before the command
    _, secret = add_client(keystore_path.parent / "clients.json", "web", audiences=["svc"], ops=["seal", "unseal"])
    side = sidecar_factory(keystore_path, uds=tmp_path / "sidecar.sock", extra=["--workers", "2"])
    codec = side.codec("svc", secret)
    tokens = [codec.seal(b"x") for _ in range(4)]
    assert [codec.unseal(t) for t in tokens] == [b"x"] * 4
    side.stop()
    res = cli("audit", "query", "--audit", url, "--json", keystore=keystore_path)
    assert res.code == 0, (res.err, side.output()[-3000:])
    events = res.json()
    assert sorted(e["op"] for e in events if e["op"] in ("seal", "unseal")) == ["seal"] * 4 + ["unseal"] * 4
    assert any(e["op"] == "ring-loaded" for e in events)
    assert not list(keystore_path.parent.glob("audit.db*"))
