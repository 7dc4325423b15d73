"""What the sidecar's readiness says when the ring's path holds what it must not load (issue 22).

One sidecar process (keystore checked every 0.2 s) meets, one after the other: a FIFO, a directory and
a symlink to ``/dev/zero`` at the ring path; a ring of the generation it serves but with other keys;
the ring made ``chmod 0644`` (a restart would refuse it). Each is reported by ``/readyz?strict=true``
(503, ``reload_error`` saying why) within 3 intervals plus scheduling slack, while seals and unseals
go on with the last good ring and the watcher keeps checking (never a wedged thread: after each case
the good ring is put back and strict readiness is 200 again). Before the fix the FIFO wedged the
watcher for good, the same-generation ring was loaded silently and the chmod went unnoticed.
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.keystores import open_keystore
from mrtr_keys.keystores.file import FileKeystore
from tests.fixtures.openbao import OpenBao
from tests.fixtures.sidecar import Sidecar
from tests.support.lateness import Relay

INTERVAL = 0.2
SLACK = 1.0
"""Seconds added to 3 intervals for HTTP polling and process scheduling, on top of how late `Relay` saw a
woken thread run meanwhile (the suite's six workers share two cores)."""
BOUND = 10.0


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _replace_with(path: Path, source: Path) -> None:
    """Put `source`'s bytes at `path` atomically, mode 0600 (a writer renaming a new file over the ring)."""
    tmp = path.with_name(".incoming")
    shutil.copyfile(source, tmp)
    tmp.chmod(0o600)
    os.replace(tmp, path)


def _clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif path.exists() or path.is_symlink():
        path.unlink()


def test_each_unloadable_ring_shows_in_strict_readiness_within_three_intervals(
    keystore_path: Path, sidecar_factory: Any, tmp_path: Path
) -> None:
    store = FileKeystore(keystore_path)
    twin = tmp_path / "twin.json"  # generation 2 of this ring, with another new key than the one served
    _replace_with(twin, keystore_path)
    run_step(FileKeystore(twin), "begin")
    run_step(store, "begin")
    s: Sidecar = sidecar_factory(keystore_path, reload_interval=INTERVAL)
    secret = s.add_client("c", ["billing"])
    good = tmp_path / "good.json"
    shutil.copyfile(keystore_path, good)
    anon, client = s.http(), s.http(secret)
    token = client.post("/v1/seal", json={"audience": "billing", "payload": b64u(b"kept")}).json()["token"]

    def strict() -> tuple[int, dict[str, Any]]:
        r = anon.get("/readyz", params={"strict": "true"})
        return r.status_code, r.json()

    def wait_for(status: int, logged: str = "", since: int = 0) -> tuple[float, dict[str, Any]]:
        """Seconds until strict readiness is `status` and the log after offset `since` names `logged`.
        The log is waited for too: a path cleared and then filled is missing for a moment, and that
        503 (no key ring at ...) can come before the one for what was put there."""
        t0 = time.monotonic()
        while True:
            code, doc = strict()
            if code == status and logged in s.output()[since:]:
                return time.monotonic() - t0, doc
            assert time.monotonic() - t0 < BOUND, (status, logged, doc, s.output()[-2000:])
            time.sleep(0.02)

    cases: dict[str, tuple[Callable[[], None], str]] = {
        "fifo": (lambda: os.mkfifo(keystore_path, 0o600), "FIFO"),
        "directory": (lambda: keystore_path.mkdir(mode=0o700), "directory"),
        "/dev/zero symlink": (lambda: keystore_path.symlink_to("/dev/zero"), "symlink"),
        "same generation, other keys": (lambda: _replace_with(keystore_path, twin), "like the loaded one"),
        "chmod 0644": (lambda: keystore_path.chmod(0o644), "chmod 600"),
    }
    assert wait_for(200)[1]["generation"] == 2
    seen: dict[str, float] = {}
    late: dict[str, float] = {}
    for name, (put, says) in cases.items():
        refusal = says == "like the loaded one"  # the one case the sidecar refuses rather than fails to load
        mark = len(s.output())
        if name not in ("same generation, other keys", "chmod 0644"):
            _clear(keystore_path)
        with Relay() as relay:
            put()
            seen[name], doc = wait_for(503, "" if refusal else says, mark)  # the log line names what is there
        late[name] = relay.overrun
        assert doc["generation"] == 2 and doc["reload_error"], (name, doc)
        if refusal:
            assert says in doc["reload_error"], (name, doc)  # a refusal is shown as such
        else:
            assert "cannot be loaded" in doc["reload_error"], (name, doc)
        assert doc["watcher"]["stuck_since"] is None  # still checking: never wedged
        r = client.post("/v1/unseal", json={"audience": "billing", "token": token})
        assert r.status_code == 200, (name, r.text)  # the last good ring serves
        if name != "chmod 0644":
            _clear(keystore_path)
        _replace_with(keystore_path, good)
        wait_for(200)
    assert s.proc.poll() is None
    for name, seconds in seen.items():
        assert seconds < 3 * INTERVAL + SLACK + late[name], (name, seen, late)
    print("seconds to strict 503:", {k: round(v, 3) for k, v in seen.items()})  # shown with pytest -s


def test_a_stuck_watcher_turns_strict_readiness_503_until_the_keystore_answers(
    tmp_path: Path, sidecar_factory: Any, monkeypatch: pytest.MonkeyPatch, openbao: OpenBao
) -> None:
    """The keystore goes silent (the session's OpenBao stopped with SIGSTOP for about a second: connections
    accepted, nothing answered; its client waits up to 3 s a call): after 3 intervals without a completed
    check `/readyz` says ``watcher stuck since ...`` (503 strict) while sealing goes on; once the keystore
    answers again, 200. Before, a blocked watcher left `/readyz?strict=true` at 200 for as long as it was."""
    env = {**openbao.env(), "BAO_CLIENT_TIMEOUT": "3", "BAO_MAX_RETRIES": "0"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    url = f"vault-kv://secret/mrtr-test/stuck-{secrets.token_hex(4)}"
    create_ring(open_keystore(url, state_dir=tmp_path / "state"), audiences=("billing",))
    s: Sidecar = sidecar_factory(url, reload_interval=INTERVAL, env={**env, "MRTR_KEYS_STATE_DIR": str(tmp_path)})
    secret = s.add_client("c", ["billing"])
    anon, client = s.http(), s.http(secret)
    assert anon.get("/readyz", params={"strict": "true"}).status_code == 200
    relay = Relay()
    os.kill(openbao.proc.pid, signal.SIGSTOP)
    try:
        silent = time.monotonic()
        while True:
            r = anon.get("/readyz", params={"strict": "true"})
            if r.status_code == 503:
                break
            assert time.monotonic() - silent < BOUND, r.text
            time.sleep(0.02)
        stuck_after = time.monotonic() - silent
        doc = r.json()
        assert doc["reload_error"].startswith("watcher stuck since ") and doc["watcher"]["stuck_since"]
        assert anon.get("/readyz").status_code == 200  # not strict: still serving
        assert "mrtr_sidecar_ring_watcher_stuck 1.0" in anon.get("/metrics").text
        sealed = client.post("/v1/seal", json={"audience": "billing", "payload": b64u(b"on")})
        assert sealed.status_code == 200  # sealing goes on with the loaded ring
    finally:
        os.kill(openbao.proc.pid, signal.SIGCONT)
        late = relay.stop()
    t0 = time.monotonic()
    while anon.get("/readyz", params={"strict": "true"}).status_code != 200:
        assert time.monotonic() - t0 < BOUND, s.output()[-2000:]
        time.sleep(0.02)
    assert "mrtr_sidecar_ring_watcher_stuck 0.0" in anon.get("/metrics").text
    # a wait, 3 intervals, slack, and how late a woken thread ran meanwhile
    assert stuck_after < 3 * INTERVAL * 1.2 + 3 * INTERVAL + SLACK + late, (stuck_after, late)
    print(f"stuck watcher: strict 503 after {stuck_after:.2f} s, 200 again {time.monotonic() - t0:.2f} s after")
