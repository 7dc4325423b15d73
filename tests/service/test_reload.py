"""Hot reload: new generations switch in without a restart; a broken ring on disk never replaces
the loaded one; SIGHUP forces a poll; the Unix socket listener is private (mode 0600)."""

from __future__ import annotations

import base64
import os
import signal
import stat
import time
from pathlib import Path
from typing import Any

from mrtr_keys.changes.rotation import run_step
from mrtr_keys.keystores.file import FileKeystore
from tests.fixtures.sidecar import Sidecar


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _seal(s: Sidecar, secret: str, payload: bytes = b"x") -> dict[str, Any]:
    r = s.http(secret).post("/v1/seal", json={"audience": "billing", "payload": b64u(payload)})
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


def test_broken_ring_on_disk_keeps_the_last_good_one(keystore_path: Path, sidecar_factory: Any) -> None:
    """A broken ring is logged, /readyz reports it, sealing continues on the last good ring;
    once the file is fixed the sidecar follows it again."""
    s: Sidecar = sidecar_factory(keystore_path, reload_interval=0.1)
    secret = s.add_client("c", ["billing"])
    store = FileKeystore(keystore_path)
    good = store.load()
    token = _seal(s, secret)["token"]
    keystore_path.write_text('{"format": "mrtr-keys.keyring", "version": 1, "keys": "broken"}')
    os.chmod(keystore_path, 0o600)
    anon = s.http()
    deadline = time.monotonic() + 10
    while anon.get("/readyz").json().get("reload_error") is None:
        assert time.monotonic() < deadline, s.output()
        time.sleep(0.05)
    ready = anon.get("/readyz")
    assert ready.status_code == 200 and ready.json()["generation"] == good.generation
    assert anon.get("/readyz", params={"strict": "true"}).status_code == 503
    assert "mrtr_sidecar_ring_stale 1.0" in anon.get("/metrics").text
    assert _seal(s, secret)["kid"] == good.primary.kid
    r = s.http(secret).post("/v1/unseal", json={"audience": "billing", "token": token})
    assert r.status_code == 200
    assert "key ring not reloaded" in s.output()
    # fix the file with a newer generation: picked up
    keystore_path.write_bytes(good.dumps())
    result = run_step(store, "begin")
    s.wait_generation(secret, result.ring.generation)
    assert anon.get("/readyz", params={"strict": "true"}).status_code == 200
    assert s.proc.poll() is None


def test_sighup_forces_a_reload(keystore_path: Path, sidecar_factory: Any) -> None:
    """On SIGHUP the sidecar polls the keystore now (here the interval is an hour)."""
    s: Sidecar = sidecar_factory(keystore_path, reload_interval=3600)
    secret = s.add_client("c", ["billing"])
    generation = run_step(FileKeystore(keystore_path), "begin").ring.generation
    time.sleep(0.3)
    assert s.generation(secret) == generation - 1
    os.kill(s.proc.pid, signal.SIGHUP)
    s.wait_generation(secret, generation, timeout=10)
    assert s.proc.poll() is None


def test_unix_socket_is_created_0600(keystore_path: Path, sidecar_factory: Any, tmp_path: Path) -> None:
    """The Unix socket listener is created with mode 0600 (only the sidecar's user may connect)."""
    sock = tmp_path / "run" / "sidecar.sock"
    s: Sidecar = sidecar_factory(keystore_path, uds=sock)
    st = os.stat(sock)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    secret = s.add_client("c", ["billing"])
    codec = s.codec("billing", secret)
    assert s.url == f"unix://{sock}"
    assert codec.unseal(codec.seal(b"over a socket")) == b"over a socket"
    s.stop()
    assert not sock.exists()
