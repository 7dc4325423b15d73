"""A silent audit store (issue 22, deliver 3): readiness tells the truth, reloads are not held up.

The PostgreSQL audit store sits behind the fault proxy, which blackholes it (connections held open,
nothing answered) while a client seals. A strict sidecar answers ``/readyz`` 503 within 2 s, naming the
audit store and since when (the error text only to an authenticated caller), refuses seals, and
``mrtr_sidecar_store_up{store="audit"}`` is 0. A ring rotation during the blackhole is served within the
normal propagation time (``ring-loaded`` follows in the background); once the store answers again the
sidecar is ready again and ``ring-loaded`` of the new generation is stored.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from mrtr_keys.audit.capture.service_sink import SidecarAudit
from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.writing.fingerprint import Fingerprinter, load_audit_key
from mrtr_keys.audit.writing.stores.base import Query
from mrtr_keys.audit.writing.stores.url import open_store
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.service.app import create_app
from mrtr_keys.service.clients import add_client
from mrtr_keys.service.config import ServiceConfig
from tests.audit.test_resend import flushed
from tests.fixtures.audit import verified
from tests.support.lateness import Relay
from tests.support.proxy import CountingProxy

pytestmark = pytest.mark.e2e
RELOAD = 0.2


def test_a_blackholed_audit_store_turns_strict_readiness_503_within_2_s_and_never_holds_up_a_reload(
    keystore_path: Path, tmp_path: Path, pg_fault_proxy: tuple[CountingProxy, str], postgres_url: str
) -> None:
    proxy, url = pg_fault_proxy
    sink = AuditSink(open_store(url), Fingerprinter(load_audit_key(tmp_path)), mode="process", url=url)
    _, secret = add_client(keystore_path.parent / "clients.json", "web", audiences=["svc"], ops=["seal", "unseal"])
    auth = {"authorization": f"Bearer {secret}"}
    config = ServiceConfig(strict_audit=True, reload_interval=RELOAD)
    app = create_app(config, keystore=str(keystore_path), audit=SidecarAudit(sink, strict=True))
    stop = threading.Event()
    codes: list[int] = []
    with TestClient(app) as http:

        def traffic() -> None:
            while not stop.is_set():
                codes.append(http.post("/v1/seal", json={"audience": "svc", "payload": "AA"}, headers=auth).status_code)
                time.sleep(0.02)

        loader = threading.Thread(target=traffic, daemon=True)
        try:
            assert http.get("/readyz").status_code == 200
            loader.start()
            time.sleep(0.5)
            proxy.faults.blackhole()
            started = time.monotonic()
            while http.get("/readyz").status_code != 503:
                assert time.monotonic() - started < 5, "still ready 5 s into the blackhole"
                time.sleep(0.05)
            to_503 = time.monotonic() - started
            anon = http.get("/readyz").json()
            detail = http.get("/readyz", headers=auth).json()
            metrics = http.get("/metrics").text
            generation = http.get("/v1/keys", headers=auth).json()["generation"]
            with Relay() as relay:  # how late a woken thread runs on this busy host (tests.support.lateness)
                begun = run_step(FileKeystore(keystore_path), "begin")
                t0 = time.monotonic()
                while http.get("/v1/keys", headers=auth).json()["generation"] != begun.ring.generation:
                    elapsed = time.monotonic() - t0
                    assert elapsed < 3 * RELOAD + 1 + relay.overrun, "the new generation was not served in time"
                    time.sleep(0.02)
                to_switch = time.monotonic() - t0
            refused = http.post("/v1/seal", json={"audience": "svc", "payload": "AA"}, headers=auth).status_code
            # past the 2 s write deadline the blocked write is cut, while the store is still silent (a write
            # without a deadline would wait for as long as the blackhole lasts; a busy host may report late)
            while sink.write_failures == 0 and time.monotonic() - started < 10:
                time.sleep(0.05)
            cut = sink.write_failures
        finally:
            proxy.faults.restore()
        back = time.monotonic()
        while http.get("/readyz").status_code != 200:
            assert time.monotonic() - back < 15, "not ready again 15 s after the store came back"
            time.sleep(0.1)
        to_ready = time.monotonic() - back
        stop.set()
        loader.join(10)
    print(
        f"blackholed audit store: /readyz 503 after {to_503:.2f} s; generation {generation} -> "
        f"{begun.ring.generation} served {to_switch:.2f} s after the rotation; ready {to_ready:.2f} s after restore; "
        f"writes cut at their deadline: {cut}"
    )
    assert to_503 <= 2.0
    assert list(anon["down"]) == ["audit"] and anon["down"]["audit"].endswith("Z")
    assert "audit" not in anon and "127.0.0.1" not in str(anon) and "postgres" not in str(anon)
    assert detail["audit"]["healthy"] is False and "acknowledged no write" in detail["audit"]["error"]
    assert 'mrtr_sidecar_store_up{store="audit"} 0.0' in metrics
    assert refused == 503 and 503 in codes
    assert cut > 0  # the writer's blocked write ended at its deadline (it did not wait for the store)
    assert flushed(sink, 30)
    loaded = [r.event.generation for r in sink.store.query(Query(op="ring-loaded"))]
    assert begun.ring.generation in loaded
    sink.close()
    assert verified(open_store(postgres_url).records(), sink).ok  # the writes cut at their deadline were re-sent once
