"""The sink never blocks a seal: a full queue drops, counts and logs; a stalled store recovers."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mrtr_keys.audit.capture.observer import AuditObserver
from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.writing.stores.base import Query
from mrtr_keys.audit.writing.stores.url import open_store
from mrtr_keys.codecs.local import LocalAESGCMCodec
from tests.support.proxy import CountingProxy
from tests.support.waiting import until


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


def test_the_documented_queue_bounds_are_the_codes() -> None:
    # docs/audit.md said 100 000 events while the code held 50 000.
    import re

    from mrtr_keys.audit.capture.queue import DEFAULT_CAPACITY, DEFAULT_MAX_BYTES, DEFAULT_MAX_WAIT
    from mrtr_keys.audit.writing.writer.child import MAX_TX_EVENTS

    doc = (Path(__file__).parents[2] / "docs" / "audit.md").read_text()
    m = re.search(r"The queue holds at most ([\d ]+) events and (\d+) MiB", doc)
    assert m is not None
    assert int(m.group(1).replace(" ", "")) == DEFAULT_CAPACITY and int(m.group(2)) << 20 == DEFAULT_MAX_BYTES
    assert f"at most {DEFAULT_MAX_WAIT:g} s" in doc
    assert f"transactions of up to {MAX_TX_EVENTS:,}".replace(",", " ") in doc
    assert "`kill -9`" in doc and "loses" in doc


def _spaced(n: int) -> str:
    """`n` with a space between thousands, as docs/audit.md writes numbers."""
    return f"{n:,}".replace(",", " ")


def test_the_documented_shipping_figures_are_the_codes() -> None:
    from mrtr_keys.audit.capture.shipper import FRAME, KEEP, MAX_WAIT, SHIP_AT, SHIP_DELAY
    from mrtr_keys.audit.writing.writer.child import ACK_INTERVAL
    from mrtr_keys.token import MAX_TOKEN_CHARS

    doc = " ".join((Path(__file__).parents[2] / "docs" / "audit.md").read_text().split())
    assert f"the token cap, {MAX_TOKEN_CHARS >> 20} MiB ({_spaced(MAX_TOKEN_CHARS)} characters)" in doc
    assert f"queues the {SHIP_AT}th item, or an item while the oldest has waited {SHIP_DELAY * 1000:g} ms" in doc
    assert f"(up to {_spaced(FRAME)} items, leaving the newest {KEEP} queued" in doc
    assert "backing off to once a second" in doc and MAX_WAIT == 1.0
    assert f"at most every {ACK_INTERVAL:g} s" in doc


def _stored_one_through_a_proxy(
    pg_fault_proxy: tuple[CountingProxy, str], make_sink: Callable[..., AuditSink]
) -> tuple[AuditSink, CountingProxy]:
    """A thread-mode sink over the test database through its fault proxy, one event stored through it."""
    proxy, url = pg_fault_proxy
    sink = make_sink(url, interval=0.01)
    sink.record("seal", kid="aaaaaaaa", token="mk1.A0")
    assert sink.flush(timeout=10)
    return sink, proxy


def _count(url: str) -> int:
    """How many records the store at `url` holds."""
    store = open_store(url)
    try:
        return store.count()
    finally:
        store.close()


def test_closing_while_the_store_is_down_counts_the_batch_it_did_not_take_as_dropped(
    pg_fault_proxy: tuple[CountingProxy, str],
    make_sink: Callable[..., AuditSink],
    postgres_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Thread mode: a batch whose write failed has left the queue; a close before the store is back
    counts it in `dropped` and says so (every event is stored or counted, never neither)."""
    sink, proxy = _stored_one_through_a_proxy(pg_fault_proxy, make_sink)
    proxy.stop()
    for i in range(10):
        sink.record("seal", kid="bbbbbbbb", token=f"mk1.B{i}")
    until(lambda: sink.write_failures > 0)
    with caplog.at_level(logging.WARNING, logger="mrtr_keys.audit"):
        sink.close(timeout=1)
    assert sink.dropped == 10 and sink.written == 1
    assert "10 events dropped: the sink closed while the store could not write them" in caplog.text
    assert _count(postgres_url) == 1


def test_closing_while_a_batch_is_being_stored_counts_it_if_the_store_does_not_take_it(
    pg_fault_proxy: tuple[CountingProxy, str],
    make_sink: Callable[..., AuditSink],
    postgres_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Thread mode: close() stops waiting for the background thread while its append hangs on a store that
    does not answer (a blackhole, cut at the write deadline). The batch is counted as dropped all the same
    (close() read the failed batch before the append failed, found none, and the 10 went uncounted)."""
    sink, proxy = _stored_one_through_a_proxy(pg_fault_proxy, make_sink)
    proxy.faults.blackhole()
    for i in range(10):
        sink.record("seal", kid="bbbbbbbb", token=f"mk1.B{i}")
    time.sleep(0.2)  # the background thread's append of the 10 waits for the store (2 s write deadline)
    with caplog.at_level(logging.WARNING, logger="mrtr_keys.audit"):
        sink.close(timeout=0.1)
        until(lambda: sink.written + sink.dropped >= 11)  # the append failed at its deadline, and was counted
    written, dropped = sink.written, sink.dropped
    assert _count(postgres_url) == 1
    assert (written, dropped) == (1, 10), caplog.text


def test_closing_while_the_failed_batch_is_stored_again_counts_it_once(
    pg_fault_proxy: tuple[CountingProxy, str],
    make_sink: Callable[..., AuditSink],
    postgres_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Thread mode: close() stops waiting for the background thread while it stores the batch the store
    did not take again, on a slow link, and that append succeeds. The batch is counted once, as written
    (close() had read it as failed and counted all 10 as dropped too)."""
    sink, proxy = _stored_one_through_a_proxy(pg_fault_proxy, make_sink)
    proxy.stop()
    for i in range(10):
        sink.record("seal", kid="bbbbbbbb", token=f"mk1.B{i}")
    until(lambda: sink.write_failures > 0)
    proxy.faults.latency(0.05)  # slow, not down: storing the 10 again takes a few round trips
    proxy.start()
    until(sink._direct.chain.lock.locked)  # the background thread is in the append of the 10
    with caplog.at_level(logging.WARNING, logger="mrtr_keys.audit"):
        sink.close(timeout=0.01)
        until(lambda: sink.written + sink.dropped >= 11)  # the append ended, and was counted
    written, dropped = sink.written, sink.dropped
    proxy.faults.restore()
    assert _count(postgres_url) == written
    assert (written, dropped) == (11, 0), caplog.text


def test_a_ring_loaded_write_waiting_on_a_silent_store_makes_the_sink_unhealthy_while_it_waits(
    pg_fault_proxy: tuple[CountingProxy, str], make_sink: Callable[..., AuditSink]
) -> None:
    """A synchronous write (the ``ring-loaded`` of a reload, a ring change) to a store that holds its
    connection without answering waits until the connection breaks. With nothing else waiting on the store
    the sink said healthy all that time: in issue 40's 60-minute run a sidecar resumed from a 15 s pause into
    an audit store outage reloaded the ring, its ``ring-loaded`` waited 8 s, and its ``/readyz`` said 200
    with the store down. Readiness now counts such a wait as silence (SILENT_AFTER, 1 s), as it does for
    batches the writer has not acknowledged."""
    import threading

    sink, proxy = _stored_one_through_a_proxy(pg_fault_proxy, make_sink)
    proxy.faults.blackhole()
    writer = threading.Thread(target=sink.ring_loaded, args=("svc", 7, "aaaaaaaa"), daemon=True)
    writer.start()
    reason = None
    while writer.is_alive() and reason is None:  # until the write gives up (its 2 s deadline) or is seen
        if not sink.healthy:
            reason = sink.last_error
        time.sleep(0.05)
    proxy.faults.restore()
    writer.join(30)
    assert reason is not None, "the sink said healthy for as long as the write waited"
    assert "has not answered a write for" in reason
    until(sink.probe, 30, "the store answering again")
    sink.close()
