"""A PostgreSQL audit store that flaps under load: nothing stored twice, every event accounted for.

The database sits behind the fault proxy; while a thread records ~500 events a second, the proxy cuts
and restores every connection 10 times (0.3 s down, 0.3 s up) and once resets a connection right after
its ``COMMIT`` went up (the server applied it, the writer never heard). Afterwards `mrtr-keys audit
verify` passes, no ``(writer, seq)`` is stored twice, and ``submitted == stored + dropped`` exactly
(issue 22, deliver 1). The same through a sidecar: every answered seal is stored once or counted dropped.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
from fastapi.testclient import TestClient

from mrtr_keys.audit.fingerprint import Fingerprinter, load_audit_key
from mrtr_keys.audit.service_sink import SidecarAudit
from mrtr_keys.audit.sink import AuditSink
from mrtr_keys.audit.stores.url import open_store
from mrtr_keys.service.app import create_app
from mrtr_keys.service.clients import add_client
from mrtr_keys.service.config import ServiceConfig
from tests.audit.test_resend import flushed
from tests.fixtures.audit import cli
from tests.support.proxy import CountingProxy


def test_ten_flaps_and_a_lost_commit_under_load_store_each_event_once(
    make_sink: Callable[..., AuditSink], pg_fault_proxy: tuple[CountingProxy, str], postgres_url: str
) -> None:
    proxy, url = pg_fault_proxy
    sink = make_sink(url, mode="process")
    submitted = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal submitted
        while not stop.is_set():
            for _ in range(25):
                sink.record("seal", kid="k1", token=f"tok{submitted}")
                submitted += 1
            time.sleep(0.05)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    time.sleep(0.5)
    flapper = proxy.faults.flap(10, down=0.3, up=0.3)
    time.sleep(3.2)
    proxy.faults.reset_after(0, after=b"COMMIT")
    flapper.join(30)
    time.sleep(0.5)
    stop.set()
    loader.join(10)
    assert flushed(sink, 60)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        stored = conn.execute("SELECT COUNT(*) FROM audit_events WHERE op = 'seal'").fetchone()[0]  # type: ignore[index]
        twice = conn.execute(
            "SELECT COUNT(*) FROM (SELECT writer, seq FROM audit_events GROUP BY writer, seq HAVING COUNT(*) > 1) d"
        ).fetchone()[0]  # type: ignore[index]
    result = cli("audit", "verify", "--audit", postgres_url)
    print(
        f"flaps={proxy.faults.flaps} lost-commit resets={proxy.faults.resets} submitted={submitted} "
        f"stored={stored} dropped={sink.dropped} duplicates={twice} verify={result.code}: {result.out.strip()[:120]}"
    )
    assert proxy.faults.flaps == 10
    assert twice == 0
    assert result.code == 0, result.out + result.err
    assert submitted == stored + sink.dropped


def test_a_sidecar_whose_audit_store_flaps_stores_each_answered_request_once(
    keystore_path: Path, tmp_path: Path, pg_fault_proxy: tuple[CountingProxy, str], postgres_url: str
) -> None:
    proxy, url = pg_fault_proxy
    sink = AuditSink(open_store(url), Fingerprinter(load_audit_key(tmp_path)), mode="process", url=url)
    _, secret = add_client(keystore_path.parent / "clients.json", "web", audiences=["svc"], ops=["seal", "unseal"])
    app = create_app(ServiceConfig(), keystore=str(keystore_path), audit=SidecarAudit(sink))
    auth = {"authorization": f"Bearer {secret}"}
    batch = {"items": [{"audience": "svc", "payload": "AAAA"}] * 20}
    answered = 0
    with TestClient(app) as http:
        flapper = proxy.faults.flap(10, down=0.3, up=0.3)
        while flapper.is_alive():
            assert http.post("/v1/seal/batch", json=batch, headers=auth).status_code == 200
            answered += 20
            time.sleep(0.02)
        assert flushed(sink, 60)
        metrics = http.get("/metrics").text
    dropped = int(float(re.search(r"^mrtr_sidecar_audit_dropped_total (\S+)$", metrics, re.M).group(1)))  # type: ignore[union-attr]
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        stored = conn.execute("SELECT COUNT(*) FROM audit_events WHERE op = 'seal'").fetchone()[0]  # type: ignore[index]
        twice = conn.execute(
            "SELECT COUNT(*) FROM (SELECT writer, seq FROM audit_events GROUP BY writer, seq HAVING COUNT(*) > 1) d"
        ).fetchone()[0]  # type: ignore[index]
    sink.close()
    result = cli("audit", "verify", "--audit", postgres_url)
    print(
        f"sidecar: flaps={proxy.faults.flaps} answered={answered} stored={stored} dropped={dropped} duplicates={twice}"
    )
    assert twice == 0 and result.code == 0, result.out
    assert answered == stored + dropped
