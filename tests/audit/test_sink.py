"""The sink never blocks a seal: a full queue drops, counts and logs; a stalled store recovers."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from mrtr_keys.audit.observer import AuditObserver
from mrtr_keys.audit.sink import AuditSink
from mrtr_keys.audit.stores.base import Query
from mrtr_keys.codecs.local import LocalAESGCMCodec


def test_full_queue_counts_drops_logs_and_never_blocks_a_seal(
    keystore_path: Path, tmp_path: Path, make_sink: Callable[..., AuditSink], caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    sink = make_sink(url, capacity=20, interval=0.01)
    codec = LocalAESGCMCodec(keystore_path, audience="svc", observer=AuditObserver(sink, audience="svc"))
    stall = sqlite3.connect(tmp_path / "audit.db", timeout=0)
    stall.execute("BEGIN EXCLUSIVE")  # another process holds the write lock: the writer stalls
    try:
        with caplog.at_level(logging.WARNING, logger="mrtr_keys.audit"):
            tokens = [codec.seal(b"x") for _ in range(300)]  # returns although nothing can be written
        assert len(tokens) == 300
        assert sink.dropped > 0
        assert any("events dropped so far" in r.getMessage() for r in caplog.records)
    finally:
        stall.rollback()
        stall.close()
    assert sink.flush(timeout=30)
    stored = sink.store.query(Query(op="seal"))
    assert len(stored) + sink.dropped == 300
    assert sink.healthy


def test_unwritable_store_makes_the_sink_unhealthy_then_recovers(
    keystore_path: Path, tmp_path: Path, make_sink: Callable[..., AuditSink]
) -> None:
    sink = make_sink(f"sqlite://{tmp_path}/audit.db", interval=0.01)
    sink.store._conn.execute("PRAGMA busy_timeout = 0")  # type: ignore[attr-defined]
    stall = sqlite3.connect(tmp_path / "audit.db", timeout=0)
    stall.execute("BEGIN EXCLUSIVE")
    sink.record("seal", kid="aaaaaaaa", token="mk1.AAAA")
    sink.flush(timeout=5)
    assert not sink.healthy and sink.last_error
    stall.rollback()
    stall.close()
    assert sink.flush(timeout=10)
    assert sink.healthy
    assert [r.event.kid for r in sink.store.query(Query(op="seal"))] == ["aaaaaaaa"]
