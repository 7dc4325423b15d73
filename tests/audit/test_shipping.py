"""Process mode's shipping (`mrtr_keys.audit.capture.shipper`): the submitting threads ship, events still
arrive without a flush, a retraction finds its item, and a stopped writer never blocks a caller.

Rules: our own decisions, stated in `mrtr_keys.audit.capture.shipper` and `mrtr_keys.audit.capture.queue`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mrtr_keys.audit.capture.items import AuditItem, new_item
from mrtr_keys.audit.capture.shipper import MAX_WAIT, SHIP_AT
from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.writing.stores.base import Query
from tests.fixtures.audit import known_events, verified


def _item(i: int, op: str = "seal", size: int = 0) -> AuditItem:
    token = f"mk1.token{i}" + "x" * size
    return new_item((op, "ok", "abcd1234", token, None, time.time(), "svc", 1, "web", 0.5))


def _wait_count(sink: AuditSink, n: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        have = sink.store.count()
        if have >= n or time.monotonic() > deadline:
            return have
        time.sleep(0.05)


def test_a_built_item_is_an_audit_item_with_its_fields_in_order() -> None:
    item = new_item(("unseal", "rejected", "k", "t", "seal", 1.5, "aud", 3, "c", 0.25))
    assert isinstance(item, AuditItem)
    assert item == AuditItem("unseal", "rejected", "k", "t", "seal", 1.5, "aud", 3, "c", 0.25)
    assert (item.op, item.reason, item.generation) == ("unseal", "seal", 3)


def test_a_burst_of_events_reaches_the_store_without_a_flush(
    tmp_path: Path, make_sink: Callable[..., AuditSink]
) -> None:
    """The submitting thread ships whole frames; the rest follows within the background thread's
    longest sleep, with nobody calling flush()."""
    sink = make_sink(f"sqlite://{tmp_path}/audit.db", mode="process")
    n = 3 * SHIP_AT + 17
    for i in range(n):
        sink.submit(_item(i))
    assert _wait_count(sink, n, timeout=10 * MAX_WAIT + 10) == n
    deadline = time.monotonic() + 10
    while sink.written < n and time.monotonic() < deadline:  # acknowledged lazily, within ACK_INTERVAL
        time.sleep(0.05)
    assert sink.dropped == 0 and sink.written == n


def test_a_trickle_of_events_reaches_the_store_without_a_flush(
    tmp_path: Path, make_sink: Callable[..., AuditSink]
) -> None:
    sink = make_sink(f"sqlite://{tmp_path}/audit.db", mode="process")
    for i in range(5):
        sink.submit(_item(i))
        time.sleep(0.02)
    assert _wait_count(sink, 5, timeout=10 * MAX_WAIT + 10) == 5


def test_a_retraction_replaces_its_queued_item_and_a_late_one_is_an_event_of_its_own(
    tmp_path: Path, make_sink: Callable[..., AuditSink]
) -> None:
    sink = make_sink(f"sqlite://{tmp_path}/audit.db", mode="process")
    early = _item(1, "unseal")
    sink.submit(early)
    sink.retract(early, "request binding")  # still queued: replaced in place
    late = _item(2, "unseal")
    sink.submit(late)
    assert sink.flush(30)
    sink.retract(late, "expired")  # already stored: recorded as a rejection of its own
    assert sink.flush(30)
    rows = [(r.event.op, r.event.outcome, r.event.reason) for r in sink.store.query(Query())]
    assert rows == [
        ("unseal", "rejected", "request binding"),
        ("unseal", "ok", None),
        ("unseal", "rejected", "expired"),
    ]


def test_a_stopped_writer_never_blocks_a_caller_and_everything_queued_is_stored_once_it_resumes(
    tmp_path: Path, make_sink: Callable[..., AuditSink]
) -> None:
    """With the writer process stopped (SIGSTOP), the pipe fills and the submitting threads keep
    going (non-blocking writes; past the high-water mark they are slowed at most `max_wait`)."""
    sink = make_sink(f"sqlite://{tmp_path}/audit.db", mode="process", max_wait=0.2)
    sink.submit(_item(0))
    assert sink.flush(30)
    child = sink.child_pid
    assert child is not None
    os.kill(child, signal.SIGSTOP)
    try:
        submitted = 1
        done = threading.Event()

        def produce() -> None:
            nonlocal submitted
            for i in range(1, 8_001):  # 32 MB of tokens: past the pipe, the outbox and the queue's bound
                sink.submit(_item(i, size=4_000))
                submitted += 1
            done.set()

        threading.Thread(target=produce, daemon=True).start()
        assert done.wait(60), "a caller was blocked by a stopped writer"
    finally:
        os.kill(child, signal.SIGCONT)
    assert sink.flush(60)
    assert sink.dropped > 0  # the stop was felt: the queue reached its bound
    assert sink.store.count() + sink.dropped == submitted
    assert sink.written == sink.store.count()


def test_a_str_enum_audience_is_recorded_as_its_text_and_never_raises_into_seal(
    keystore_path: Path, tmp_path: Path, make_sink: Callable[..., AuditSink]
) -> None:
    """`marshal` refuses `str` subclasses; a codec built with a `StrEnum` audience must still seal,
    and its events must be stored with the plain text (found by a trial run)."""
    import enum

    from mrtr_keys.audit.capture.observer import AuditObserver
    from mrtr_keys.codecs.local import LocalAESGCMCodec

    class Audience(enum.StrEnum):
        SVC = "svc"

    sink = make_sink(f"sqlite://{tmp_path}/audit.db", mode="process")
    codec = LocalAESGCMCodec(keystore_path, audience=Audience.SVC, observer=AuditObserver(sink, audience=Audience.SVC))
    for _ in range(2 * SHIP_AT):  # enough for the sealing thread to ship frames itself
        codec.seal(b"payload")
    assert sink.flush(30)
    seals = sink.store.query(Query(op="seal"))
    assert len(seals) == 2 * SHIP_AT and {r.event.audience for r in seals} == {"svc"}
    assert sink.dropped == 0 and sink.queued == 0


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_a_killed_writer_loses_nothing_silently_and_frames_it_never_read_go_to_its_successor(
    store: str, tmp_path: Path, make_sink: Callable[..., AuditSink], request: pytest.FixtureRequest
) -> None:
    """Exactly what the killed writer had read and not stored is counted in `dropped` (what it
    stored after its last acknowledgement is found in the store, docs/audit.md); frames that never
    reached it go to its successor, and no frame is counted twice (found by a trial run: one frame
    was, and frames sent to the dead writer before it was reaped were dropped). So every event is
    stored or counted, never both, and none is stored twice."""
    url = request.getfixturevalue("postgres_url") if store == "postgresql" else f"sqlite://{tmp_path}/audit.db"
    sink = make_sink(url, mode="process")
    sink.submit(_item(0))
    assert sink.flush(30)
    first = sink.child_pid
    assert first is not None
    submitted = 1
    stop = threading.Event()

    def produce() -> None:
        nonlocal submitted
        i = 1
        while not stop.is_set():
            sink.submit(_item(i))
            submitted += 1
            i += 1
            if i % SHIP_AT == 0:  # about 50 frames a second: frames in flight at the kill, not a flood to store
                time.sleep(0.02)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    time.sleep(0.3)
    os.kill(first, signal.SIGKILL)
    time.sleep(0.5)
    stop.set()
    producer.join(10)
    assert sink.flush(60)
    assert sink.children_started == 2 and sink.healthy
    stored = sink.store.count()
    assert submitted == stored + sink.dropped
    assert sink.written == stored  # what the dead writer stored unacknowledged is counted written, not lost
    records = list(sink.store.records())
    assert {r.writer for r in records} == {f"{sink.writer}/p1", f"{sink.writer}/p2"}
    assert verified(records, sink).ok


@pytest.mark.parametrize("store", ["sqlite", "postgresql", "jsonl"])
def test_every_store_tells_how_far_a_chain_got(
    store: str, tmp_path: Path, make_sink: Callable[..., AuditSink], request: pytest.FixtureRequest
) -> None:
    """What the parent asks after its writer died: the length of one chain, among events since a time."""
    urls = {"sqlite": f"sqlite://{tmp_path}/audit.db", "jsonl": f"jsonl://{tmp_path}/audit.jsonl"}
    url = request.getfixturevalue("postgres_url") if store == "postgresql" else urls[store]
    one, other = make_sink(url), make_sink(url)
    events = known_events(6)  # times 2026-07-28T10:00:00 .. :05
    one.write_now(events[:2])
    other.write_now(events[2:3])
    one.write_now(events[3:])
    assert one.store.chain_length(one.writer, "2026-07-28T10:00:00.000000Z") == 5
    assert one.store.chain_length(one.writer, "2026-07-28T10:00:04.000000Z") == 5
    assert one.store.chain_length(other.writer, "2026-07-28T10:00:00.000000Z") == 1
    assert one.store.chain_length(one.writer, "2026-07-28T10:00:06.000000Z") == 0  # nothing that recent
    assert one.store.chain_length("no-such-writer", "2026-07-28T10:00:00.000000Z") == 0
