"""The run walk of SQLite schema 4 (raw rows rendered to their hash text, `narrow.Pieces.runs`; split
across two processes for a large log, `verify_parallel`) reports exactly what the row walk reports,
on genuine logs and on each kind of hand edit, including values of another type or shape than the
writer's (text where an integer is stored, quotes, a BLOB, a REAL seq, a renamed name id).

The row walk (``runs=False``) is the reference: it decodes every row and ``repr`` s it.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bench.audit_log import fill

from mrtr_keys.audit.verifying.trust import verify_store
from mrtr_keys.audit.verifying.verify_stream import MAX_PENDING
from mrtr_keys.audit.writing.stores.url import open_store
from tests.fixtures.audit import keys_of, sqlite_exec

KEY = bytes(range(32))
"""The audit key the logs are written and verified with."""

EDITS = {
    "genuine": (),
    "deleted": ("DELETE FROM audit_events WHERE id = 333",),
    "deleted batch end": ("DELETE FROM audit_events WHERE id = 400",),
    "altered reason": ("UPDATE audit_events SET reason = 'innocent' WHERE id = 333",),
    "quote in client": ("UPDATE audit_events SET client = 'it''s' WHERE id = 333",),
    "backslash and newline": ("UPDATE audit_events SET kid = 'a\\b' || char(10) WHERE id = 333",),
    "unicode kid": ("UPDATE audit_events SET kid = 'clé' WHERE id = 333",),
    "blob client": ("UPDATE audit_events SET client = CAST(client AS BLOB) WHERE id = 333",),
    "time plus 1 us": ("UPDATE audit_events SET time = time + 1 WHERE id = 333",),
    "time as text": ("UPDATE audit_events SET time = '2026-01-01T00:00:00.000000Z' WHERE id = 333",),
    "negative time": ("UPDATE audit_events SET time = -5 WHERE id = 333",),
    "generation real": ("UPDATE audit_events SET generation = 1.5 WHERE id = 333",),
    "duration null": ("UPDATE audit_events SET duration_ms = NULL WHERE id = 333",),
    "fingerprint text": ("UPDATE audit_events SET fingerprint = lower(hex(fingerprint)) WHERE id = 333",),
    "fingerprint null": ("UPDATE audit_events SET fingerprint = NULL WHERE id = 333",),
    "writer as its name": (
        "UPDATE audit_events SET writer = (SELECT name FROM audit_names WHERE id = writer) WHERE id = 333",
    ),
    "instance unknown id": ("UPDATE audit_events SET instance = 999 WHERE id = 333",),
    "name renamed": (
        "UPDATE audit_names SET name = name || 'x' WHERE id = (SELECT instance FROM audit_events WHERE id = 1)",
    ),
    "seq real": ("UPDATE audit_events SET seq = seq + 0.0 WHERE id = 333",),
    "prev_hash on a middle row": ("UPDATE audit_events SET prev_hash = 'x' WHERE id = 333",),
    "hash on a middle row": ("UPDATE audit_events SET hash = 'x' WHERE id = 333",),
    "inserted copy": (
        "INSERT INTO audit_events (time, instance, client, audience, kid, op, outcome, reason, fingerprint,"
        " generation, duration_ms, writer, seq, prev_hash, hash) SELECT time, instance, client, audience,"
        " kid, op, outcome, reason, fingerprint, generation, duration_ms, writer, seq, prev_hash, hash"
        " FROM audit_events WHERE id = 333",
    ),
    "reordered": (
        "UPDATE audit_events SET id = 100000 WHERE id = 333",
        "UPDATE audit_events SET id = 333 WHERE id = 334",
        "UPDATE audit_events SET id = 334 WHERE id = 100000",
    ),
    "moved far": ("UPDATE audit_events SET id = 100000 WHERE id = 333",),
    "tail cut": ("DELETE FROM audit_events WHERE id = (SELECT MAX(id) FROM audit_events)",),
}
LONG_EDITS = {  # one batch longer than MAX_PENDING: hashed incrementally, a link checked first
    "genuine": (),
    "altered": ("UPDATE audit_events SET reason = 'x' WHERE id = 9000",),
    "relinked and altered": (
        "UPDATE audit_events SET reason = 'x' WHERE id = 5",
        "UPDATE audit_events SET prev_hash = 'y' WHERE hash <> ''",
    ),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("runs")
    paths = {"short": root / "short.db", "long": root / "long.db"}
    fill(f"sqlite://{paths['short']}", 1_200, tx=100, audit_key=KEY)  # 12 batches on 3 chains
    fill(f"sqlite://{paths['long']}", MAX_PENDING + 808, tx=MAX_PENDING + 808, chains=1, audit_key=KEY)
    for path in paths.values():
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
    yield paths


def _walks(path: Path) -> list[dict[str, Any]]:
    store = open_store(f"sqlite://{path}")
    try:
        reports = [
            verify_store(store, [], runs=False, page=7, keys=keys_of(KEY)),
            verify_store(store, [], page=7, keys=keys_of(KEY)),
            verify_store(store, [], page=97, split_min_rows=0, keys=keys_of(KEY)),
        ]
    finally:
        store.close()
    out = []
    for r in reports:
        doc = r.to_json()
        doc.pop("seconds")
        doc.pop("records_per_second")
        out.append(doc)
    return out


def _edited(bases: dict[str, Path], base: str, edits: tuple[str, ...], tmp_path: Path) -> Path:
    path = tmp_path / "audit.db"
    shutil.copy(bases[base], path)
    if edits:
        sqlite_exec(f"sqlite://{path}", *edits)
    return path


@pytest.mark.parametrize("case", list(EDITS))
def test_the_run_walk_reports_what_the_row_walk_reports(case: str, bases: dict[str, Path], tmp_path: Path) -> None:
    reference, runs, split = _walks(_edited(bases, "short", EDITS[case], tmp_path))
    assert runs == reference
    assert split == reference
    assert reference["ok"] is (
        case in ("genuine", "writer as its name", "fingerprint text", "seq real")
    )  # same values read back


@pytest.mark.parametrize("case", list(LONG_EDITS))
def test_a_batch_longer_than_max_pending_is_judged_alike(case: str, bases: dict[str, Path], tmp_path: Path) -> None:
    reference, runs, split = _walks(_edited(bases, "long", LONG_EDITS[case], tmp_path))
    assert runs == reference
    assert split == reference
    assert reference["ok"] is (case == "genuine")
    if case == "relinked and altered":
        assert reference["first_break"]["kind"] == "inserted"


def test_rows_pruned_while_the_split_walk_reads_them_are_a_retry_not_a_crash(tmp_path: Path) -> None:
    """The children render pages ahead of the walk and the walk reads a batch's last row again: a
    prune committing in between (the sidecar's retention beside a cron verify) used to end verify
    with IndexError (``internal error``); it is AuditUnavailable (exit 75, run again) in one line."""
    import multiprocessing
    import time

    from mrtr_keys.errors import AuditUnavailable

    path = tmp_path / "audit.db"
    fill(f"sqlite://{path}", 200, tx=100, chains=1, audit_key=KEY)  # two pages of 100: one child each
    store = open_store(f"sqlite://{path}")
    pruned: list[int] = []

    def progress(records: int, seconds: float) -> None:
        if pruned:
            return
        while multiprocessing.active_children():  # both pages rendered and sent: prune the second
            time.sleep(0.01)
        pruned.append(records)
        sqlite_exec(f"sqlite://{path}", "DELETE FROM audit_events WHERE id > 100")

    try:
        with pytest.raises(AuditUnavailable, match=r"changed while they were read .* run verify again"):
            verify_store(store, [], page=100, split_min_rows=0, progress=progress, keys=keys_of(KEY))
    finally:
        store.close()
    assert pruned == [100]


def test_a_reading_child_killed_midway_is_an_outage_to_retry_not_a_broken_chain(tmp_path: Path) -> None:
    """A child killed while verify runs (the OOM killer, an operator) is exit 75 (AuditUnavailable:
    run again), not exit 1, which the runbook keeps for a broken chain."""
    import multiprocessing
    import os
    import signal

    from mrtr_keys.errors import AuditError, AuditUnavailable

    path = tmp_path / "audit.db"
    fill(f"sqlite://{path}", 2_000, tx=100, chains=1, audit_key=KEY)  # 4 pages of 500 rows, each more than a pipe holds
    before = set(multiprocessing.active_children())
    killed: list[int] = []

    def progress(records: int, seconds: float) -> None:
        if not killed:  # both children are blocked sending their next page: neither has finished
            for child in set(multiprocessing.active_children()) - before:
                os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
                killed.append(child.pid)  # type: ignore[arg-type]

    store = open_store(f"sqlite://{path}")
    try:
        with pytest.raises(AuditError) as info:
            verify_store(store, [], page=500, split_min_rows=0, progress=progress, keys=keys_of(KEY))
    finally:
        store.close()
    assert len(killed) == 2
    assert isinstance(info.value, AuditUnavailable) and info.value.exit_code == 75
    assert str(info.value) == "audit verify: a reading process ended early (killed?): run verify again"
