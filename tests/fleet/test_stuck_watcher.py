"""A ring watcher that stops completing checks is reported, and holds the rotation gates (issue 22).

Before: a watcher blocked in a keystore call left its instance live on its old generation in `fleet
status`, and `rotate retire` passed while that instance still opened tokens of the retired key. Now the
watcher records its last completed check; older than 3 intervals, the instance's heartbeat says ``watcher
stuck since ...``, `fleet status` shows it (status ``stuck``, not ``live``, and the note), and promote /
retire count the instance as not having loaded anything newer until it checks again. The hang is a real
file keystore whose ``stat`` blocks while a test event is set (a filesystem that stops answering), with
short intervals so the test takes about a second.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from mrtr_keys.changes.rotation import run_step
from mrtr_keys.factory import request_state_security
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.keystores.watch import STUCK_INTERVALS, RingWatcher
from mrtr_keys.ring.model import utcnow
from tests.fixtures.audit import cli
from tests.support.lateness import Relay

INTERVAL = 0.1
BOUND = 10.0


class HangingKeystore(FileKeystore):
    """The ring file, whose ``stat`` hangs while `hang` is set (until `hang` is cleared or BOUND passes)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.hang = threading.Event()
        self.released = threading.Event()

    def revision(self) -> str:
        if self.hang.is_set():
            self.released.wait(BOUND)
        return super().revision()


def _wait(what: Any, why: str) -> None:
    deadline = time.monotonic() + BOUND
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.01)


def test_a_stuck_watcher_is_reported_and_holds_retire_until_it_checks_again(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    assert cli("rotate", "begin", keystore=ring).code == 0  # generation 2
    store = HangingKeystore(ring)
    codec = request_state_security(store, audience="svc", reload_every=INTERVAL, instance="svc-stuck").codec
    watcher: RingWatcher = codec.watcher  # type: ignore[attr-defined]
    run_step(FileKeystore(ring), "promote", now=utcnow() - timedelta(hours=2))  # generation 3, time gate open
    _wait(lambda: codec.ring.generation == 3, "generation 3 not loaded")  # type: ignore[attr-defined]
    assert watcher.stuck_since() is None

    with Relay() as relay:
        store.hang.set()  # the next check blocks in the keystore
        hung = time.monotonic()
        _wait(lambda: watcher.stuck_since() is not None, "never reported stuck")
        took = time.monotonic() - hung
    # a wait, 3 intervals, slack, and how late a woken thread ran meanwhile (tests.support.lateness)
    assert took < (STUCK_INTERVALS + 1.2) * INTERVAL + 1.0 + relay.overrun, (took, relay.overrun)
    assert codec.presence.beat()  # type: ignore[attr-defined]  # what the heartbeat writes within 0.5 s
    (row,) = cli("fleet", "status", "--json", keystore=ring).json()
    assert (row["name"], row["status"], row["current"], row["generation"]) == ("svc-stuck", "stuck", False, 3)
    assert row["note"].startswith("watcher stuck since ")
    table = cli("fleet", "status", keystore=ring).out.splitlines()
    assert table[0].endswith("generation 3: 0 live, 1 stuck, 0 stale, 0 stopped"), table
    assert next(line for line in table if line.startswith("svc-stuck ")).endswith(" stuck"), table
    assert any(line.startswith("  svc-stuck: watcher stuck since") for line in table), table
    res = cli("rotate", "retire", keystore=ring)  # generation 3 is loaded, but nothing newer ever will be
    assert res.code == 75, res.out
    assert "retire not yet" in res.err and "stuck ring watcher" in res.err and "svc-stuck (generation 3" in res.err

    store.released.set()  # the filesystem answers again: the watcher checks, and says so
    _wait(lambda: watcher.stuck_since() is None, "still stuck after the keystore answered")
    assert watcher.error is None and watcher.running
    assert codec.presence.beat()  # type: ignore[attr-defined]
    (row,) = cli("fleet", "status", "--json", keystore=ring).json()
    assert (row["status"], row["current"], row["note"]) == ("live", True, None)
    res = cli("rotate", "retire", keystore=ring)
    assert res.code == 0, res.err
    assert codec.presence.beat()  # type: ignore[attr-defined]
    assert cli("fleet", "status", keystore=ring).out.splitlines()[0].endswith(": 1 live, 0 stale, 0 stopped")
    watcher.stop()


def test_an_instance_both_stuck_and_fenced_out_says_both_in_its_heartbeat(tmp_path: Path) -> None:
    """Cut from its keystore, an instance's watcher gets stuck and, its lease run out, it serves fenced out; the
    heartbeat said only ``watcher stuck since ...`` (the first note won), so `fleet status` never showed that it
    served calls on its last good ring (issue 40's chaos run, seed 21: 84 fenced-out calls of five instances
    behind a blackholed OpenBao, none in a heartbeat). The stuck note still leads: the gates read it."""
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    store = HangingKeystore(ring)
    codec = request_state_security(store, audience="svc", reload_every=INTERVAL, instance="svc-cut", lease=0.3).codec
    watcher: RingWatcher = codec.watcher  # type: ignore[attr-defined]
    store.hang.set()
    try:
        _wait(lambda: watcher.stuck_since() is not None, "never reported stuck")
        assert codec.unseal(codec.seal(b"served on the last good ring")) == b"served on the last good ring"
        assert codec.presence.beat()  # type: ignore[attr-defined]
        (row,) = cli("fleet", "status", "--json", keystore=ring).json()
    finally:
        store.released.set()
    stuck, _, fenced = row["note"].partition("; fenced out: ")
    assert row["status"] == "stuck" and stuck.startswith("watcher stuck since ")
    assert fenced.startswith("served 2 call(s) on the last good ring without a keystore check"), row["note"]
