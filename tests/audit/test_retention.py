"""The retention loop's rules without a sidecar: a run that passes its deadline deletes nothing and says
so; the cut-off never enters the window the rotation gates read (TTL + 60 s)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.audit_log import fill

from mrtr_keys.audit.events import format_ts
from mrtr_keys.audit.retention.loop import Retention
from mrtr_keys.audit.writing.chain_key import ChainKey
from mrtr_keys.audit.writing.stores.url import open_store


def test_a_run_past_its_deadline_deletes_nothing_and_the_next_one_prunes(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    key = os.urandom(32)
    fill(url, 3_000, tx=500, audit_key=key)
    loop = Retention(url, "30d", tmp_path / "cps.jsonl", lambda: 600.0, deadline=0.0, chain_keys=[ChainKey(key)])
    assert not loop.run_once()
    assert loop.last_error and "passed its 0 s deadline" in loop.last_error and loop.last_success is None
    store = open_store(url)
    assert store.count() == 3_000
    loop.deadline = 60.0
    assert loop.run_once() and loop.last_error is None and loop.last_deleted >= 500
    assert store.count() == 3_000 - loop.last_deleted
    store.close()


def test_the_cutoff_stays_out_of_the_gate_window(tmp_path: Path) -> None:
    now = float(int(time.time()))  # whole seconds: both sides format the same instant
    loop = Retention("sqlite://x", "90s", tmp_path / "cps.jsonl", lambda: 3_600.0)
    assert loop.cutoff(now) == format_ts(now - 3_660)
    assert Retention("sqlite://x", "30d", tmp_path / "c", lambda: 3_600.0).cutoff(now) == format_ts(now - 30 * 86_400)
