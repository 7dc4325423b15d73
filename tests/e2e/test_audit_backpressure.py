"""A store slowed on purpose: the sidecar slows or refuses its callers, and never drops an event silently.

The store is SQLite; another connection holds its write lock, so the writer process waits for it (it
has not failed, it is only slow). With 4 KB tokens the queue, the pipe to the writer and the writer's
read-ahead fill within a few hundred events, and then the queue passes its high-water mark.
"""

from __future__ import annotations

import base64
import logging
import re
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from mrtr_keys.audit.capture.service_sink import SidecarAudit
from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.writing.fingerprint import Fingerprinter, load_audit_key
from mrtr_keys.audit.writing.stores.base import Query
from mrtr_keys.audit.writing.stores.url import open_store
from mrtr_keys.service.app import create_app
from mrtr_keys.service.clients import add_client
from mrtr_keys.service.config import ServiceConfig

PAYLOAD = base64.urlsafe_b64encode(b"p" * 3000).rstrip(b"=").decode()
BATCH = {"items": [{"audience": "svc", "payload": PAYLOAD}] * 100}


class Sidecar:
    def __init__(self, keystore_path: Path, tmp_path: Path, *, strict: bool, max_wait: float) -> None:
        self.db = tmp_path / "audit.db"
        url = f"sqlite://{self.db}"
        self.sink = AuditSink(
            open_store(url), Fingerprinter(load_audit_key(tmp_path)), capacity=200, max_wait=max_wait, mode="process"
        )
        _, secret = add_client(keystore_path.parent / "clients.json", "web", audiences=["svc"], ops=["seal", "unseal"])
        audit = SidecarAudit(self.sink, strict=strict)
        self.http = TestClient(create_app(ServiceConfig(strict_audit=strict), keystore=str(keystore_path), audit=audit))
        self.auth = {"authorization": f"Bearer {secret}"}

    def seal_batch(self) -> int:
        return self.http.post("/v1/seal/batch", json=BATCH, headers=self.auth).status_code

    @contextmanager
    def store_locked(self) -> Iterator[None]:
        """Hold the store's write lock for the block (the writer waits: slow, not failing), however long a
        busy host takes to run it."""
        lock = sqlite3.connect(self.db, timeout=30, check_same_thread=False)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            lock.rollback()
            lock.close()

    def lock_store(self, seconds: float) -> threading.Thread:
        """Hold the store's write lock for `seconds` from another thread (the callers may be slowed meanwhile)."""
        held = self.store_locked()
        held.__enter__()

        def release() -> None:
            threading.Event().wait(seconds)
            held.__exit__(None, None, None)

        t = threading.Thread(target=release, daemon=True)
        t.start()
        return t

    def metric(self, name: str) -> float:
        m = re.search(rf"^{name} (\S+)$", self.http.get("/metrics").text, re.M)
        assert m is not None, name
        return float(m.group(1))

    def stored_seals(self) -> int:
        return len(self.sink.store.query(Query(op="seal")))


@pytest.fixture
def make_sidecar(keystore_path: Path, tmp_path: Path) -> Iterator[object]:
    made: list[Sidecar] = []

    def make(**kw: object) -> Sidecar:
        s = Sidecar(keystore_path, tmp_path, **kw)  # type: ignore[arg-type]
        made.append(s)
        return s

    yield make
    for s in made:
        s.http.close()
        s.sink.close()


def test_a_slow_store_slows_the_callers_and_loses_nothing(make_sidecar) -> None:  # type: ignore[no-untyped-def]
    side = make_sidecar(strict=False, max_wait=30.0)
    assert side.seal_batch() == 200 and side.sink.flush(timeout=30)
    released = side.lock_store(1.0)  # the writer is stuck for 1 s, then free again
    for _ in range(20):  # 2,000 events: far more than the queue, the pipe and the writer's read-ahead
        assert side.seal_batch() == 200
    released.join()
    assert side.sink.flush(timeout=60)
    assert side.metric("mrtr_sidecar_audit_slowed_total") > 0  # callers waited for the writer instead of losing events
    assert side.metric("mrtr_sidecar_audit_dropped_total") == 0 == side.sink.dropped
    assert side.stored_seals() == 2100


def test_a_stalled_store_drops_only_past_the_bound_counts_each_one_and_says_so(
    make_sidecar,  # type: ignore[no-untyped-def]
    caplog: pytest.LogCaptureFixture,
) -> None:
    side = make_sidecar(strict=False, max_wait=0.2)
    assert side.seal_batch() == 200 and side.sink.flush(timeout=30)
    # held past the time callers may be slowed, until 2,000 events are sealed: the bound is reached
    with side.store_locked(), caplog.at_level(logging.WARNING, logger="mrtr_keys.audit"):
        for _ in range(20):
            assert side.seal_batch() == 200  # non-strict: served, slowed at most 0.2 s once
    assert side.sink.flush(timeout=60)
    dropped = side.metric("mrtr_sidecar_audit_dropped_total")
    assert dropped > 0 and dropped == side.sink.dropped
    assert side.stored_seals() + dropped == 2100  # what is missing from the store is exactly what was counted
    assert any("events dropped so far" in r.getMessage() for r in caplog.records)
    assert side.http.get("/readyz", headers=side.auth).json()["audit"]["dropped"] == dropped


def test_a_strict_sidecar_refuses_while_the_writer_is_behind_and_records_every_seal_it_made(
    make_sidecar,  # type: ignore[no-untyped-def]
) -> None:
    side = make_sidecar(strict=True, max_wait=0.2)
    assert side.seal_batch() == 200 and side.sink.flush(timeout=30)
    with side.store_locked():
        codes = [side.seal_batch() for _ in range(20)]
    assert 503 in codes  # refused once the queue passed its high-water mark
    assert side.sink.flush(timeout=60)
    served_items = 100 * codes.count(200)
    # A refused batch stops at its first refused item; the items before it were sealed and recorded.
    assert side.sink.dropped == 0 and side.metric("mrtr_sidecar_audit_dropped_total") == 0
    assert side.stored_seals() >= 100 + served_items
    assert side.seal_batch() == 200  # the writer caught up: served again
