"""The ring watcher: a cheap revision check every interval, a full read only when the ring
changed, errors kept and recovered from, a stop, and one implementation for codecs and the sidecar."""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path

import pytest

from mrtr_keys.changes.rotation import run_step
from mrtr_keys.factory import open_codec
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.keystores.watch import RingWatcher, watch_codec
from mrtr_keys.ring.model import KeyRing
from tests.support.waiting import until


class CountingKeystore(FileKeystore):
    """A real file keystore that counts full reads."""

    loads = 0

    def load(self) -> KeyRing:
        self.loads += 1
        return super().load()


def test_file_revision_changes_with_every_write_and_only_then(keystore: FileKeystore) -> None:
    first = keystore.revision()
    assert keystore.revision() == first
    run_step(keystore, "begin")
    second = keystore.revision()
    assert second != first and keystore.revision() == second


def test_a_codec_reads_the_ring_only_when_its_revision_changed(keystore_path: Path) -> None:
    store = CountingKeystore(keystore_path)
    codec = open_codec(store, audience="svc", reload_every=0)
    watcher = RingWatcher(store, codec.reload, interval=0)  # driven by hand: no thread, no sleeping
    before = store.loads
    assert watcher.check() is False  # the first check always reads (a change during start-up is not missed)
    assert store.loads == before + 1
    for _ in range(5):
        assert watcher.check() is False
    assert store.loads == before + 1 and watcher.checks == 6 and watcher.reads == 1
    generation = run_step(FileKeystore(keystore_path), "begin").ring.generation
    assert watcher.check() is True
    assert codec.ring.generation == generation and watcher.reads == 2


def test_a_keystore_outage_keeps_the_loaded_ring_and_recovers(
    keystore_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    codec = open_codec(keystore_path, audience="svc", reload_every=0)
    watcher = RingWatcher(FileKeystore(keystore_path), codec.reload, interval=0)
    watcher.check()
    token = codec.seal(b"round 1")
    aside = keystore_path.with_name("aside.json")
    os.rename(keystore_path, aside)
    with caplog.at_level(logging.WARNING, logger="mrtr_keys.reload"):
        assert watcher.check() is False
        assert watcher.check() is False
    assert watcher.error is not None and "no key ring at" in watcher.error
    assert sum("key ring not reloaded" in r.message for r in caplog.records) == 1  # once per distinct error
    assert codec.unseal(token) == b"round 1"  # still serving the last good ring
    os.rename(aside, keystore_path)
    generation = run_step(FileKeystore(keystore_path), "begin").ring.generation
    assert watcher.check() is True and watcher.error is None
    assert codec.ring.generation == generation


def test_the_thread_follows_a_rotation_and_stops(keystore_path: Path) -> None:
    codec = open_codec(keystore_path, audience="svc", reload_every=0.05)
    watcher = codec.watcher  # type: ignore[attr-defined]
    assert watcher.running
    generation = run_step(FileKeystore(keystore_path), "begin").ring.generation
    deadline = time.monotonic() + 10
    while codec.ring.generation != generation:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    watcher.stop()
    assert not watcher.running


@pytest.mark.parametrize("checked", [0, 3], ids=["before-its-first-check", "after-checks"])
def test_the_thread_ends_once_its_codec_is_gone(keystore_path: Path, checked: int) -> None:
    """Also when the keystore does not change after the codec is gone: the watcher calls `reload` (which finds
    the codec gone) only on a change, so a codec dropped after its first check left its thread polling the
    keystore for as long as the process lived (a full run held to 0.7 of a core failed on it)."""
    codec = open_codec(keystore_path, audience="svc", reload_every=0.05)
    watcher = codec.watcher  # type: ignore[attr-defined]
    until(lambda: watcher.checks >= checked)
    checks = watcher.checks
    del codec
    gc.collect()
    until(lambda: not watcher.running, what="the thread ends")
    assert watcher.checks <= checks + 1  # no keystore check once it was gone (one may have been under way)
    assert watcher.stuck_note() is None  # ended, not stuck


def test_reload_off_says_so_in_the_log(keystore_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mrtr_keys.reload"):
        codec = open_codec(keystore_path, audience="svc", reload_every=0)
    assert codec.watcher is None  # type: ignore[attr-defined]
    assert any("automatic key ring reload is off" in r.message for r in caplog.records)
    assert watch_codec(codec, FileKeystore(keystore_path), interval=0) is None


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), 10**6, True, "2"])
def test_a_bad_interval_is_a_config_error(keystore_path: Path, bad: object) -> None:
    from mrtr_keys.errors import ConfigError

    with pytest.raises(ConfigError, match="reload_every"):
        open_codec(keystore_path, audience="svc", reload_every=bad)  # type: ignore[arg-type]


def test_waits_are_jittered_within_20_percent(keystore: FileKeystore) -> None:
    low = RingWatcher(keystore, lambda: False, interval=2.0, rng=lambda: 0.0)
    high = RingWatcher(keystore, lambda: False, interval=2.0, rng=lambda: 0.999999)
    assert low.next_delay() == pytest.approx(1.6) and high.next_delay() == pytest.approx(2.4)
