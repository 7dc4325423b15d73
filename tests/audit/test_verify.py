"""`verify` finds a deleted, an edited, an inserted and a reordered record (SQLite, PostgreSQL, JSONL), and a cut tail.

The writer links each batch (one transaction) once: an edit shows at the first record of its batch;
a deletion, insertion or move shows at the record whose seq reveals it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.verifying.trust import verify_store
from mrtr_keys.audit.writing.chain import make_checkpoint
from mrtr_keys.audit.writing.stores.url import open_store
from tests.fixtures.audit import insert, keys_of, known_events, pg_exec, sqlite_exec, verified

TAMPER = {
    "deleted": ("DELETE FROM audit_events WHERE seq = 3",),
    "altered": ("UPDATE audit_events SET reason = 'innocent' WHERE seq = 3",),
    "inserted": (
        "INSERT INTO audit_events (time, instance, client, audience, kid, op, outcome, reason, fingerprint,"
        " generation, duration_ms, writer, seq, prev_hash, hash)"
        " SELECT time, instance, client, audience, kid, op, outcome, 'forged', fingerprint, generation,"
        " duration_ms, writer, seq, prev_hash, hash FROM audit_events WHERE seq = 3",
    ),
    "reordered": (
        "UPDATE audit_events SET id = id + 1000 WHERE seq = 3",
        "UPDATE audit_events SET id = id - 1 WHERE seq = 4",
        "UPDATE audit_events SET id = id - 1000 + 1 WHERE seq = 3",
    ),
}


def _check(url: str, kind: str, execute: Callable[..., None], make_sink: Callable[..., AuditSink]) -> None:
    sink = make_sink(url)
    insert(sink, known_events(6))
    store = open_store(url)
    assert verified(store.records(), sink).ok
    execute(url, *TAMPER[kind])
    report = verified(store.records(), sink)
    assert not report.ok
    streamed = verify_store(store, [], page=2, keys=keys_of(sink)).first  # pages of two rows: breaks across page ends
    assert streamed is not None and report.first is not None
    assert (streamed.kind, streamed.seq, streamed.position) == (
        report.first.kind,
        report.first.seq,
        report.first.position,
    )
    first = report.first
    assert first is not None and first.kind == kind
    # reported by position (storage order) and time: an edit at the first record of its batch (the 6
    # events are one batch), a deletion or a move at the 4th (whose seq reveals it), an insertion at
    # the forged copy of seq 3 (stored last)
    want_seq = {"deleted": 4, "reordered": 4, "altered": 1, "inserted": 3}[kind]
    assert first.seq == want_seq
    assert first.time == known_events(6)[want_seq - 1].time
    assert first.position > 0
    store.close()


@pytest.mark.parametrize("kind", ["deleted", "altered", "inserted", "reordered"])
def test_sqlite_verify_detects(kind: str, tmp_path: Path, make_sink: Callable[..., AuditSink]) -> None:
    _check(f"sqlite://{tmp_path}/audit.db", kind, sqlite_exec, make_sink)


@pytest.mark.parametrize("kind", ["deleted", "altered", "inserted", "reordered"])
def test_postgres_verify_detects(kind: str, postgres_url: str, make_sink: Callable[..., AuditSink]) -> None:
    _check(postgres_url, kind, pg_exec, make_sink)


def test_jsonl_reordered_lines_are_detected(tmp_path: Path, make_sink: Callable[..., AuditSink]) -> None:
    path = tmp_path / "audit.jsonl"
    sink = make_sink(f"jsonl://{path}")
    insert(sink, known_events(5))
    lines = path.read_text().splitlines()
    lines[2], lines[3] = lines[3], lines[2]  # line 1 is the schema version
    path.write_text("\n".join(lines) + "\n")
    first = verified(open_store(f"jsonl://{path}").records(), sink).first
    assert first is not None and first.kind == "reordered" and first.position == 3
    streamed = verify_store(open_store(f"jsonl://{path}"), [], keys=keys_of(sink)).first
    assert streamed is not None and (streamed.kind, streamed.position) == ("reordered", 3)


def test_a_cut_tail_is_invisible_to_the_chain_but_caught_by_a_checkpoint(
    tmp_path: Path, make_sink: Callable[..., AuditSink]
) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    sink = make_sink(url)
    insert(sink, known_events(6)[:4])
    insert(sink, known_events(6)[4:])  # a second batch: seq 5 and 6
    store = open_store(url)
    cp = make_checkpoint(store.records(), store_url=store.url, now=0.0)
    sqlite_exec(url, "DELETE FROM audit_events WHERE seq = 6")  # part of a batch: the chain shows it
    assert verified(store.records(), sink).first.kind == "truncated"  # type: ignore[union-attr]
    sqlite_exec(url, "DELETE FROM audit_events WHERE seq >= 5")  # whole batches: it cannot
    assert verified(store.records(), sink).ok  # documented limit of a chain alone
    report = verified(store.records(), sink, checkpoints=[json.loads(json.dumps(cp))])
    assert report.first is not None and report.first.kind == "truncated"
    assert "seq 6" in report.first.detail and "ends at seq 4" in report.first.detail
    streamed = verify_store(store, [json.loads(json.dumps(cp))], keys=keys_of(sink))
    assert streamed.first is not None and streamed.first.kind == "truncated"
    assert "seq 6" in streamed.first.detail and "ends at seq 4" in streamed.first.detail
