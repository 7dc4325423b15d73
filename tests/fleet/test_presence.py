"""Presence: named instances write heartbeats into the audit store; live while the last one is
younger than 3 intervals, stale after, stopped at once on a clean shutdown. Clocks are injected: no sleeping."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.audit.writing.stores.url import open_store
from mrtr_keys.errors import ConfigError
from mrtr_keys.fleet.presence import (
    LIVE,
    STALE,
    STOPPED,
    Loaded,
    Presence,
    instance_name,
    read_instances,
)
from tests.fixtures.common import REPO


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _loaded(generation: int = 4, note: str | None = None) -> Loaded:
    return Loaded("local", "r-0123456789abcdef", generation, "kid00004", note)


@pytest.mark.parametrize("scheme", ["sqlite", "jsonl"])
def test_a_heartbeat_is_live_for_three_intervals_then_stale(tmp_path: Path, scheme: str) -> None:
    store: Any = open_store(f"{scheme}:///{tmp_path}/audit.{scheme}")
    clock = Clock()
    presence = Presence(store, name="pod-a", kind="library", every=10, clock=clock)
    presence.add(lambda: _loaded())  # the first beat is written at once
    (rec,) = read_instances(store)
    assert (rec.name, rec.codec, rec.generation, rec.primary_kid, rec.kind) == (
        "pod-a",
        "local",
        4,
        "kid00004",
        "library",
    )
    assert rec.version and rec.pid and rec.every_s == 10
    assert rec.status(clock.t + 29.9) == LIVE
    assert rec.status(clock.t + 30.0) == STALE  # a crashed instance stops counting
    clock.t += 25
    assert presence.beat()
    (rec,) = read_instances(store)
    assert rec.status(clock.t + 29) == LIVE
    presence.stop()
    (rec,) = read_instances(store)
    assert rec.status(clock.t) == STOPPED  # a stopped one at once
    assert presence.beat() is False  # nothing after stop
    store.close()


def test_one_row_per_name_and_the_most_lagging_codec_is_reported(tmp_path: Path) -> None:
    store: Any = open_store(f"sqlite:///{tmp_path}/audit.db")
    presence = Presence(store, name="pod-b", kind="library", every=10, clock=Clock())
    presence.add(lambda: _loaded(5))
    presence.add(lambda: _loaded(3, "reload off"))
    presence.beat()
    (rec,) = read_instances(store)
    assert (rec.generation, rec.note) == (3, "reload off")
    store.close()


def test_when_every_codec_is_gone_the_instance_is_stopped(tmp_path: Path) -> None:
    store: Any = open_store(f"sqlite:///{tmp_path}/audit.db")
    alive = [True]
    presence = Presence(store, name="pod-c", kind="library", every=10, clock=Clock())
    presence.add(lambda: _loaded() if alive[0] else None)
    alive[0] = False
    assert presence.beat() is False
    (rec,) = read_instances(store)
    assert rec.state == STOPPED and presence.stopped
    store.close()


def test_a_store_outage_is_survived_and_recovered_from(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store: Any = open_store(f"jsonl:///{tmp_path}/audit.jsonl")
    blocker = tmp_path / "audit.jsonl.instances.json"
    blocker.mkdir()  # the presence file cannot be replaced: every write fails
    clock = Clock()
    presence = Presence(store, name="pod-d", kind="sidecar", every=10, clock=clock)
    presence.add(lambda: _loaded())
    assert presence.beat() is False and presence.beat() is False
    assert presence.error is not None
    assert sum("presence heartbeat not written" in r.message for r in caplog.records) == 1
    blocker.rmdir()
    clock.t += 10
    assert presence.beat() and presence.error is None
    (rec,) = read_instances(store)
    assert rec.status(clock.t) == LIVE


@pytest.mark.parametrize("bad", ["", " pod", "a b", "x" * 201, "-lead"])
def test_a_bad_instance_name_is_a_config_error(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MRTR_KEYS_INSTANCE", bad)
    if bad == "":
        assert instance_name().count(":") == 1  # empty: the default host:pid
        return
    with pytest.raises(ConfigError, match="instance name"):
        instance_name()


def test_the_name_comes_from_the_argument_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MRTR_KEYS_INSTANCE", "billing-7d9f8c6b5-x2x9k")
    assert instance_name() == "billing-7d9f8c6b5-x2x9k"
    assert instance_name("explicit") == "explicit"


@pytest.mark.parametrize("how", ["sigterm", "exit"])
def test_a_clean_shutdown_writes_stopped(keystore_path: Path, tmp_path: Path, how: str) -> None:
    """SIGTERM and interpreter exit both leave a `stopped` row (a process with the library's codec)."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time
        import mrtr_keys
        sec = mrtr_keys.request_state_security({str(keystore_path)!r}, audience="svc", instance="proc-1")
        print("ready", flush=True)
        if {how!r} == "sigterm":
            time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == (-signal.SIGTERM if how == "sigterm" else 0)
    store: Any = open_store(f"sqlite:///{keystore_path.parent}/audit.db")
    (rec,) = read_instances(store)
    assert (rec.name, rec.state, rec.generation) == ("proc-1", STOPPED, 1)
    store.close()
