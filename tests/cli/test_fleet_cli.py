"""`rotate ... --wait`, `rotate status`, `fleet status` and `rotate restore`."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.changes.wait import run_step_waiting
from mrtr_keys.errors import KeystoreUnavailable, NotYet
from mrtr_keys.factory import request_state_security
from mrtr_keys.keystores.file import FileKeystore
from tests.fixtures.audit import cli
from tests.fixtures.common import run_cli


class FakeTime:
    """A monotonic clock and a sleep that only moves it (no real waiting)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def test_wait_retries_a_refused_step_until_its_gate_opens(keystore: FileKeystore) -> None:
    fake = FakeTime()
    calls: list[str] = []

    def gate(step: str, ring: Any, now: Any) -> None:
        calls.append(step)
        if fake.t < 3:
            raise NotYet("instances not ready", wait_seconds=None)

    cli_begin = cli("rotate", "begin", keystore=keystore.path)
    assert cli_begin.code == 0
    seen: list[tuple[str, float]] = []
    result = run_step_waiting(
        keystore,
        "next",
        wait=10,
        gate=gate,
        clock=fake.clock,
        sleep=fake.sleep,
        on_wait=lambda s, e, left: seen.append((s, left)),
    )
    assert result.op == "promote" and result.changed
    assert set(calls) == {"promote"} and len(calls) == 4 and fake.slept == [1.0, 1.0, 1.0]
    assert seen == [("promote", 10.0), ("promote", 9.0), ("promote", 8.0)]


def test_wait_gives_up_with_the_last_refusal_when_time_runs_out(keystore: FileKeystore) -> None:
    fake = FakeTime()

    def gate(step: str, ring: Any, now: Any) -> None:
        raise NotYet("still not", wait_seconds=0.25)

    assert cli("rotate", "begin", keystore=keystore.path).code == 0
    with pytest.raises(NotYet, match="still not"):
        run_step_waiting(keystore, "promote", wait=2, gate=gate, clock=fake.clock, sleep=fake.sleep)
    assert fake.t == pytest.approx(2.0) and max(fake.slept) == 0.25  # woke when the refusal said it opens
    assert keystore.load().generation == 2  # nothing written


class Unreachable(FileKeystore):
    """The ring file, unreachable (KeystoreUnavailable, as a remote keystore's outage) for its first `loads` reads
    and its first `saves` writes."""

    def __init__(self, path: Path, *, loads: int, saves: int) -> None:
        super().__init__(path)
        self.left = {"load": loads, "save": saves}

    def _down(self, op: str) -> None:
        if self.left[op] > 0:
            self.left[op] -= 1
            raise KeystoreUnavailable("key ring is unavailable (connection refused); nothing was changed, retry later")

    def load(self) -> Any:
        self._down("load")
        return super().load()

    def save(self, ring: Any, *, expected_generation: int) -> None:
        self._down("save")
        super().save(ring, expected_generation=expected_generation)


def test_wait_rides_out_a_keystore_outage_as_it_does_a_closed_gate(keystore: FileKeystore) -> None:
    """A keystore out of reach is "retry later" (exit 75) like a closed gate: `--wait` tries again until it is done
    or the time is up. It gave up at once, so a deploy pipeline's ``rotate next --wait 900`` failed its job on a
    one-second OpenBao blip (issue 40: 75 exits from the chaos rotator within its wait, every keystore cut)."""
    fake = FakeTime()
    seen: list[tuple[str, str]] = []
    flaky = Unreachable(keystore.path, loads=2, saves=1)
    result = run_step_waiting(
        flaky,
        "next",
        wait=10,
        clock=fake.clock,
        sleep=fake.sleep,
        on_wait=lambda s, e, left: seen.append((s, type(e).__name__)),
    )
    assert result.op == "begin" and result.changed and keystore.load().generation == 2
    assert seen == [("next", "KeystoreUnavailable")] * 2 + [("begin", "KeystoreUnavailable")]
    down = Unreachable(keystore.path, loads=100, saves=100)
    with pytest.raises(KeystoreUnavailable):
        run_step_waiting(down, "promote", wait=3, clock=fake.clock, sleep=fake.sleep)
    assert keystore.load().generation == 2


def test_promote_wait_exits_75_naming_the_instance_and_shows_progress(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    stuck = request_state_security(ring, audience="svc", reload_every=0, instance="stuck-1")  # kept alive
    assert cli("rotate", "begin", keystore=ring).code == 0
    res = cli("rotate", "promote", "--wait", "1.5", keystore=ring)
    assert res.code == 75
    assert "waiting to promote: instances ready 0 of 1 (not yet: stuck-1)" in res.err
    assert res.err.strip().splitlines()[-1].startswith("mrtr-keys: promote not yet: 1 of 1 live instance(s)")
    del stuck


def test_next_wait_finishes_as_soon_as_the_instance_has_loaded(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    codec = request_state_security(ring, audience="svc", reload_every=0, instance="late-1").codec
    assert cli("rotate", "begin", keystore=ring).code == 0

    def catch_up() -> None:
        codec.reload()
        codec.presence.beat()

    timer = threading.Timer(1.0, catch_up)
    timer.start()
    res = cli("rotate", "next", "--wait", "60", "--json", keystore=ring)
    timer.join()
    assert res.code == 0, res.err
    assert res.json()["step"] == "promote" and res.json()["forced"] is False


def test_rotate_status_says_the_phase_in_one_sentence_with_the_longest_wait(keystore: FileKeystore) -> None:
    assert cli("rotate", "begin", keystore=keystore.path).code == 0
    assert cli("rotate", "promote", keystore=keystore.path).code == 0
    res = cli("rotate", "status", keystore=keystore.path)
    first = res.out.splitlines()[0]
    assert first.startswith("promoted at ") and "; retire possible in " in first
    assert first.endswith("; waiting for: TTL")
    doc = cli("rotate", "status", "--json", keystore=keystore.path).json()
    assert [w["for"] for w in doc["waits"]] == ["TTL"] and doc["wait_seconds"] == doc["waits"][0]["seconds"]


def test_fleet_status_fits_80_columns(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    long_name = "billing-mcp-server-7d9f8c6b5-x2x9k-with-a-very-long-suffix"
    kept = [
        request_state_security(ring, audience="svc", reload_every=0, instance=long_name),
        request_state_security(ring, audience="svc", instance="b-2"),
    ]
    res = cli("fleet", "status", keystore=ring)
    assert res.code == 0, res.err
    lines = res.out.splitlines()
    assert lines[0].endswith("generation 1: 2 live, 0 stale, 0 stopped")
    assert lines[1].split() == ["instance", "codec", "gen", "primary", "heartbeat", "status"]
    assert all(len(line) <= 80 for line in lines), lines
    assert any(line.startswith("b-2 ") and line.rstrip().endswith("live") for line in lines)
    assert any(line.startswith("…") and "local" in line for line in lines)  # the long name keeps its end
    assert f"  {long_name}: reload off" in lines
    del kept


def test_fleet_status_without_an_audit_store_is_one_line_exit_2(keystore: FileKeystore) -> None:
    res = cli("fleet", "status", keystore=keystore.path)
    assert res.code == 2 and "no presence" in res.err and "Traceback" not in res.err


def test_restore_writes_a_backup_back_under_a_new_generation(tmp_path: Path) -> None:
    """Instances refuse a lower generation put back by hand; `rotate restore` is the explicit way."""
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    backup = tmp_path / "backup.json"
    shutil.copy(ring, backup)
    old = FileKeystore(ring).load().primary.kid
    assert cli("rotate", "begin", keystore=ring).code == 0
    codec = request_state_security(ring, audience="svc", reload_every=0).codec
    res = cli("rotate", "restore", str(backup), "--json", keystore=ring)
    assert res.code == 0, res.err
    assert (
        res.json()["generation"] == 3
        and res.json()["message"] == f"restored generation 1 as generation 3: {old} primary"
    )
    assert codec.reload() is True and codec.ring.generation == 3 and [k.kid for k in codec.ring.keys] == [old]
    events = cli("audit", "query", "--op", "restore", "--json", keystore=ring).json()
    assert [(e["kid"], e["generation"]) for e in events] == [(old, 3)]
    shutil.copy(backup, ring)  # by hand: generation 1 over generation 3
    assert codec.reload() is False and codec.ring.generation == 3
    assert "generation 1, older than the loaded generation 3" in codec.reload_refused
    assert "mrtr-keys rotate restore FILE" in codec.reload_refused


def test_restore_refuses_another_ring(tmp_path: Path) -> None:
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert cli("init", keystore=one).code == 0 and cli("init", keystore=two).code == 0
    res = cli("rotate", "restore", str(two), keystore=one)
    assert res.code == 2 and "another key ring" in res.err and "nothing was written" in res.err
    assert FileKeystore(one).load().generation == 1


def test_restore_reads_only_a_ring_sized_regular_file(tmp_path: Path) -> None:
    """`rotate restore` read the backup with read_bytes(): a FIFO blocked for ever and /dev/zero was read until
    memory ran out (a keystore refuses both, and anything over 4 MiB). Each is now one line, exit 2, nothing written."""
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    fifo, big = tmp_path / "backup.fifo", tmp_path / "big.json"
    os.mkfifo(fifo)
    big.write_bytes(b" " * (4 * 1024 * 1024 + 1))
    for backup, said in (
        (fifo, "not a regular file (give a key ring file saved earlier)"),
        (Path("/dev/zero"), "not a regular file (give a key ring file saved earlier)"),
        (tmp_path, "not a regular file (give a key ring file saved earlier)"),
        (big, "larger than 4,194,304 bytes, larger than any key ring"),
        (tmp_path / "none.json", "No such file or directory"),
    ):
        res = run_cli("rotate", "restore", str(backup), keystore=ring, timeout=30)
        assert (res.code, res.err) == (2, f"mrtr-keys: cannot read backup {backup}: {said}\n")
    assert FileKeystore(ring).load().generation == 1


def test_restore_never_brings_a_revoked_key_back(tmp_path: Path) -> None:
    """A revocation is final (issue 37), and a backup made before it still holds the leaked key. Restoring it
    made the revoked key the primary again, its material back, on every instance. Now a backup whose primary
    was revoked since is refused (exit 2, nothing written), and any other key revoked since stays revoked."""
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    before = tmp_path / "before.json"
    shutil.copy(ring, before)
    old = FileKeystore(ring).load().primary.kid
    assert cli("keys", "revoke", old, "--reason", "leak", "--yes", keystore=ring).code == 0
    res = cli("rotate", "restore", str(before), keystore=ring)
    assert res.code == 2 and res.err.count("\n") == 1, res.err
    assert f"the backup's primary {old} was revoked at " in res.err and "nothing was written" in res.err
    stored = FileKeystore(ring).load()
    assert stored.generation == 2 and stored.lookup(old).state.value == "revoked"  # type: ignore[union-attr]

    assert cli("rotate", "begin", keystore=ring).code == 0  # a begun key, revoked after this backup
    begun = tmp_path / "begun.json"
    shutil.copy(ring, begun)
    new = next(k.kid for k in FileKeystore(ring).load().keys if k.state.value == "verify")
    codec = request_state_security(ring, audience="svc", reload_every=0).codec
    assert cli("keys", "revoke", new, "--reason", "leak too", "--yes", keystore=ring).code == 0
    assert cli("rotate", "restore", str(begun), keystore=ring).code == 0
    restored = FileKeystore(ring).load()
    key = restored.lookup(new)
    assert key is not None and key.state.value == "revoked" and key.material is None
    assert restored.lookup(old) is not None and restored.lookup(old).state.value == "revoked"  # type: ignore[union-attr]
    assert codec.reload() and new not in {k.kid for k in codec.ring.usable_keys()}
