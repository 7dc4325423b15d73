"""A sidecar batch's audit events: one event per item, in order, each with its own outcome, reason,
token fingerprint, time and duration, whether the batch is queued at once (not strict) or item by
item (strict, so that a refused item stops the batch). Rule: docs/audit.md, docs/sidecar.md."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from mrtr_keys.audit.capture.service_sink import SidecarAudit
from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.writing.fingerprint import Fingerprinter, load_audit_key
from mrtr_keys.audit.writing.stores.base import Query
from mrtr_keys.service.app import create_app
from mrtr_keys.service.clients import add_client
from mrtr_keys.service.config import ServiceConfig


def _b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@pytest.mark.parametrize("strict", [False, True])
def test_every_batch_item_is_one_event_in_order_with_its_own_outcome(
    keystore_path: Path, tmp_path: Path, make_sink: Callable[..., AuditSink], strict: bool
) -> None:
    sink = make_sink(f"sqlite://{tmp_path}/audit.db", mode="process")
    _, secret = add_client(keystore_path.parent / "clients.json", "web", audiences=["svc"], ops=["seal", "unseal"])
    app = create_app(ServiceConfig(strict_audit=strict), keystore=str(keystore_path), audit=SidecarAudit(sink))
    auth = {"authorization": f"Bearer {secret}"}
    with TestClient(app) as http:
        sealed = http.post(
            "/v1/seal/batch", json={"items": [{"audience": "svc", "payload": _b64u(b"p%d" % i)} for i in range(3)]}
        )
        assert sealed.status_code == 401  # no credentials: refused before any item
        sealed = http.post(
            "/v1/seal/batch",
            json={"items": [{"audience": "svc", "payload": _b64u(b"p%d" % i)} for i in range(3)]},
            headers=auth,
        )
        assert sealed.status_code == 200
        tokens = [r["token"] for r in sealed.json()["results"]]
        opened = http.post(
            "/v1/unseal/batch",
            json={
                "items": [
                    {"audience": "svc", "token": tokens[0]},
                    {"audience": "svc", "token": tokens[1][:-4] + "AAAA"},
                    {"audience": "other", "token": tokens[2]},
                ]
            },
            headers=auth,
        )
        assert opened.status_code == 200
    assert sink.flush(30)
    events = [r.event for r in sink.store.query(Query()) if r.event.op in ("seal", "unseal")]
    fp = Fingerprinter(load_audit_key(tmp_path)).fingerprint
    assert [(e.op, e.outcome, e.client, e.fingerprint) for e in events[-6:]] == [
        ("seal", "ok", "web", fp(tokens[0])),
        ("seal", "ok", "web", fp(tokens[1])),
        ("seal", "ok", "web", fp(tokens[2])),
        ("unseal", "ok", "web", fp(tokens[0])),
        ("unseal", "rejected", "web", fp(tokens[1][:-4] + "AAAA")),
        ("unseal", "forbidden", "web", None),  # not this client's audience: refused before decoding
    ]
    assert events[-2].reason == "seal"
    batch = events[-6:]
    assert all(e.duration_ms is not None and e.duration_ms >= 0 for e in batch)
    assert [e.time for e in batch] == sorted(e.time for e in batch)
    assert sink.dropped == 0
