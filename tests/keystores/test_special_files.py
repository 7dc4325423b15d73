"""What sits at a ring's path is never trusted to behave like a file (issue 22, gray failures).

A FIFO, a directory or a device (here a symlink to ``/dev/zero``) at the ring path is refused in one
line without blocking: before the fix, a FIFO wedged the ring watcher in ``open()`` for good while the
instance looked healthy. A ``chmod 0644`` or a ``chown`` changes the file keystore's revision, so the
watcher reads the file at once and reports what a restart would refuse, instead of at the next restart.
Each load runs in a thread joined with a bound, so a regression fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mrtr_keys.errors import KeystoreError
from mrtr_keys.factory import open_codec
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.keystores.watch import RingWatcher
from tests.support.lateness import Relay

BOUND = 5.0
"""Seconds a load may take before the test calls it wedged (a bound, not a timed assertion)."""
INTERVAL = 0.1
"""The watchers' interval here (seconds): what they report is due within 3 of them."""
SLACK = 1.0
"""Seconds added to 3 intervals for a busy shared machine (thread scheduling)."""


def bounded(fn: Callable[[], object]) -> BaseException | None:
    """Run `fn` in a daemon thread; the exception it raised (None if it returned). Fails if still running."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND)
    assert not thread.is_alive(), f"wedged: still blocked after {BOUND} s"
    return out[0]


def put_fifo(path: Path) -> str:
    os.mkfifo(path, 0o600)
    return "FIFO"


def put_directory(path: Path) -> str:
    path.mkdir(mode=0o700)
    return "directory"


def put_dev_zero(path: Path) -> str:
    path.symlink_to("/dev/zero")
    return "symlink"


def put_socket(path: Path) -> str:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return "socket"


SPECIAL = {"fifo": put_fifo, "directory": put_directory, "dev-zero symlink": put_dev_zero, "socket": put_socket}


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_special_file_at_the_ring_path_is_refused_in_one_line_without_blocking(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "keyring.json"
    named = SPECIAL[kind](path)
    store = FileKeystore(path)
    store.revision()  # a stat, never an open
    error = bounded(store.load)
    assert isinstance(error, KeystoreError), error
    assert named in str(error) and str(path) in str(error) and "\n" not in str(error)


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero symlink"])
def test_the_watcher_reports_a_special_file_within_three_intervals_and_keeps_serving(
    keystore_path: Path, kind: str
) -> None:
    codec = open_codec(keystore_path, audience="svc", reload_every=INTERVAL)
    watcher: RingWatcher = codec.watcher  # type: ignore[attr-defined]
    token = codec.seal(b"before")
    aside = keystore_path.with_name("aside.json")
    os.rename(keystore_path, aside)
    with Relay() as relay:
        SPECIAL[kind](keystore_path)
        placed = time.monotonic()
        while watcher.error is None:
            assert time.monotonic() - placed < BOUND, "never reported"
            time.sleep(0.01)
        reported = time.monotonic() - placed
    assert reported < 3 * INTERVAL + SLACK + relay.overrun, (reported, relay.overrun)  # tests.support.lateness
    assert "not a regular file" in watcher.error or "symlink" in watcher.error
    last = watcher.last_check
    deadline = time.monotonic() + BOUND
    while watcher.last_check == last:  # still checking: never wedged
        assert time.monotonic() < deadline, "no check completed since"
        time.sleep(0.01)
    assert watcher.running and watcher.stuck_since() is None
    assert codec.unseal(token) == b"before"  # the last good ring serves
    if keystore_path.is_dir() and not keystore_path.is_symlink():
        keystore_path.rmdir()
    else:
        keystore_path.unlink()
    os.rename(aside, keystore_path)
    deadline = time.monotonic() + BOUND
    while watcher.error is not None:
        assert time.monotonic() < deadline, watcher.error
        time.sleep(0.01)
    watcher.stop()


def test_chmod_or_chown_changes_the_revision_so_the_watcher_sees_what_a_restart_would(keystore_path: Path) -> None:
    store = FileKeystore(keystore_path)
    codec = open_codec(store, audience="svc", reload_every=0)
    watcher = RingWatcher(store, codec.reload, interval=0)  # driven by hand
    assert watcher.check() is False and watcher.error is None
    before = store.revision()
    os.chmod(keystore_path, 0o644)
    assert store.revision() != before
    watcher.check()
    assert watcher.error is not None and "chmod 600" in watcher.error  # what a restart would refuse, now
    os.chmod(keystore_path, 0o600)
    watcher.check()
    assert watcher.error is None and store.revision() == before
    if os.geteuid() == 0:  # only root can give the file away
        os.chown(keystore_path, 1, 1)
        assert store.revision() != before
        os.chown(keystore_path, 0, 0)
        assert store.revision() == before
