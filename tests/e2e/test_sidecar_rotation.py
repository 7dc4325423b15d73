"""Rotation under traffic through the sidecar: begin, promote, retire while clients seal and
unseal continuously; zero failures for tokens that should stay valid, and the sidecar never restarts."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.keystores.file import FileKeystore
from tests.fixtures.sidecar import Sidecar


def test_rotation_under_traffic(tmp_path: Path, sidecar_factory: Any) -> None:
    ring_path = tmp_path / "keyring.json"
    store = FileKeystore(ring_path)
    create_ring(store, ttl=1)  # short TTL; retire is forced anyway
    s: Sidecar = sidecar_factory(ring_path, reload_interval=0.1)
    secret = s.add_client("loop", ["billing"])
    pid = s.proc.pid
    old_kid = store.load().primary.kid
    early = s.codec("billing", secret).seal(b"sealed before the rotation")

    stop = threading.Event()
    ops: list[int] = []
    """The traffic thread of each completed round trip (seal, unseal by the codec, unseal over HTTP)."""
    failures: list[str] = []
    kids: set[str] = set()

    def traffic(n: int) -> None:
        codec = s.codec("billing", secret)
        http = s.http(secret)
        i = 0
        while not stop.is_set():
            payload = f"{n}-{i}".encode()
            try:
                token = codec.seal(payload)
                if codec.unseal(token) != payload:
                    failures.append(f"mismatch {payload!r}")
                kids.add(http.post("/v1/unseal", json={"audience": "billing", "token": token}).json()["kid"])
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
            i += 1
            ops.append(n)

    def traffic_flows(rounds: int = 3) -> None:
        """Wait until every traffic thread has made `rounds` more round trips (a phase is under traffic
        however slow a busy host makes each one; before, the test counted round trips over fixed sleeps)."""
        mark, deadline = len(ops), time.monotonic() + 30
        while any(ops[mark:].count(n) < rounds for n in range(len(threads))):
            assert time.monotonic() < deadline and not failures, (len(ops) - mark, failures)
            time.sleep(0.02)

    threads = [threading.Thread(target=traffic, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    try:
        traffic_flows()
        begun = run_step(store, "begin")
        s.wait_generation(secret, begun.ring.generation)
        traffic_flows()
        promoted = run_step(store, "promote")
        s.wait_generation(secret, promoted.ring.generation)
        assert s.codec("billing", secret).unseal(early) == b"sealed before the rotation"  # OLD still verifies
        traffic_flows()  # every thread sealed and unsealed again: no token sealed under OLD is left in flight
        retired = run_step(store, "retire", force=True)
        s.wait_generation(secret, retired.ring.generation)
        traffic_flows()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)

    assert failures == []
    assert kids == {old_kid, begun.details["new"]}
    with pytest.raises(InvalidRequestState):
        s.codec("billing", secret).unseal(early)
    r = s.http(secret).post("/v1/unseal", json={"audience": "billing", "token": early})
    assert (r.status_code, r.content) == (400, b'{"error":"invalid_token"}')  # like every other failure
    assert "retired kid" in s.output()
    assert s.proc.poll() is None and s.proc.pid == pid
