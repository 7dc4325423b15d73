"""A PostgreSQL audit store that goes away and comes back: the sidecar recovers by itself.

The database sits behind a TCP proxy the test stops (every connection cut, new ones refused) and
starts again, as a restart or a network blip would. Strict mode refuses while the store is gone and
serves again within 5 s of its return; non-strict mode keeps serving, writes what it queued during the
outage once the store is back, counts exactly what it could not keep, and its readiness recovers
without a restart.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

from fastapi.testclient import TestClient

from mrtr_keys.audit.capture.service_sink import SidecarAudit
from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.writing.fingerprint import Fingerprinter, load_audit_key
from mrtr_keys.audit.writing.stores.base import Query
from mrtr_keys.audit.writing.stores.url import open_store
from mrtr_keys.service.app import create_app
from mrtr_keys.service.clients import add_client
from mrtr_keys.service.config import ServiceConfig
from tests.support.proxy import CountingProxy
from tests.support.waiting import until


def _sidecar(keystore_path: Path, sink: AuditSink, *, strict: bool) -> tuple[TestClient, dict[str, str]]:
    _, secret = add_client(keystore_path.parent / "clients.json", "web", audiences=["svc"], ops=["seal", "unseal"])
    app = create_app(
        ServiceConfig(strict_audit=strict), keystore=str(keystore_path), audit=SidecarAudit(sink, strict=strict)
    )
    return TestClient(app), {"authorization": f"Bearer {secret}"}


def test_strict_sidecar_refuses_during_a_database_outage_and_serves_within_5_s_of_its_return(
    keystore_path: Path, tmp_path: Path, pg_fault_proxy: tuple[CountingProxy, str]
) -> None:
    proxy, url = pg_fault_proxy
    sink = AuditSink(open_store(url), Fingerprinter(load_audit_key(tmp_path)), mode="process", url=url)
    http, auth = _sidecar(keystore_path, sink, strict=True)
    seal = {"audience": "svc", "payload": "AA"}
    try:
        assert http.post("/v1/seal", json=seal, headers=auth).status_code == 200
        assert sink.flush(timeout=30)
        proxy.stop()  # the database is gone: open connections cut, new ones refused
        http.post("/v1/seal", json=seal, headers=auth)  # queued; its write fails
        until(lambda: http.get("/readyz").status_code == 503, 30)
        refused = http.post("/v1/seal", json=seal, headers=auth)
        assert refused.status_code == 503 and refused.json() == {"error": "audit_unavailable"}
        proxy.start()
        back = until(lambda: http.post("/v1/seal", json=seal, headers=auth).status_code == 200, 5.0)
        assert http.get("/readyz").status_code == 200
        print(f"strict: seals served again {back:.2f} s after the database came back")
        assert sink.flush(timeout=30)
        assert len(sink.store.query(Query(op="seal"))) == 3  # before, during (written after), after
    finally:
        http.close()
        sink.close()


def test_non_strict_sidecar_writes_the_outage_backlog_after_it_and_counts_exactly_what_it_lost(
    keystore_path: Path, tmp_path: Path, pg_fault_proxy: tuple[CountingProxy, str]
) -> None:
    proxy, url = pg_fault_proxy
    # A small queue and 3 KB payloads (4 KB tokens): the pipe to the writer and the queue fill during
    # the outage, so some events must be dropped, and each one must be counted.
    sink = AuditSink(open_store(url), Fingerprinter(load_audit_key(tmp_path)), capacity=200, mode="process", url=url)
    http, auth = _sidecar(keystore_path, sink, strict=False)
    payload = base64.urlsafe_b64encode(b"p" * 3000).rstrip(b"=").decode()
    batch = {"items": [{"audience": "svc", "payload": payload}] * 100}
    try:
        assert http.post("/v1/seal/batch", json=batch, headers=auth).status_code == 200
        assert sink.flush(timeout=30)
        proxy.stop()
        for _ in range(20):  # the sidecar keeps serving without its store
            assert http.post("/v1/seal/batch", json=batch, headers=auth).status_code == 200
        assert http.get("/readyz").status_code == 503
        sink.ring_loaded(None, 7, "kid00007")  # cannot be written now: kept, written once the store is back
        proxy.start()
        until(lambda: http.get("/readyz").status_code == 200, 30)  # by itself: no flush, no restart
        assert sink.flush(timeout=60)
        metrics = http.get("/metrics").text
        m = re.search(r"^mrtr_sidecar_audit_dropped_total (\S+)$", metrics, re.M)
        assert m is not None
        dropped = int(float(m.group(1)))
        stored = len(sink.store.query(Query(op="seal")))
        print(f"non-strict: 2,100 seals, {stored} events stored, {dropped} dropped")
        assert 0 < dropped < 2000 and stored + dropped == 2100
        assert [r.event.generation for r in sink.store.query(Query(op="ring-loaded"))] == [1, 7]
    finally:
        http.close()
        sink.close()
