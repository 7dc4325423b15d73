"""Fleet controls: the gates can fail, a restarted fleet does not hold them, and a ring that
goes back (lower generation, another ring_id) is refused under traffic.

Real processes: example MCP servers (`mrtr_keys.request_state_security`) and sidecars, sharing one key ring
and the default SQLite audit store beside it; presence is read from that store.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from mrtr_keys.audit.writing.stores.url import default_url, open_store
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.fleet.presence import InstanceRecord, read_instances
from mrtr_keys.keystores.file import FileKeystore
from tests.e2e.servers import ServerPool, first_round, retry_round, text_of
from tests.e2e.traffic import Traffic
from tests.fixtures.common import run_cli
from tests.fixtures.sidecar import start_sidecar
from tests.support import tls
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

FAST = ("--ttl", "10", "--heartbeat-every", "1")


def _presence(ring: Path) -> dict[str, InstanceRecord]:
    store: Any = open_store(default_url(ring.parent))
    try:
        return {r.name: r for r in read_instances(store)}
    finally:
        store.close()


def test_an_instance_with_reload_off_blocks_the_gates_and_after_a_forced_promote_looks_once_at_the_new_kid(
    tmp_path: Path,
) -> None:
    ring = tmp_path / "keyring.json"
    assert run_cli("init", "--ttl", "10", keystore=ring).code == 0
    with ServerPool(tmp_path / "servers") as pool:
        live = pool.launch(keystore=ring, instance="live-1", extra_args=FAST)
        frozen = pool.launch(keystore=ring, instance="frozen", extra_args=(*FAST, "--reload-every", "0"))
        pool.wait_ready()
        assert run_cli("rotate", "begin", keystore=ring).code == 0
        res = run_cli("rotate", "promote", "--wait", "3", keystore=ring)
        assert res.code == 75
        assert "have not loaded generation 2: frozen (generation 1, heartbeat" in res.err and "reload off" in res.err
        assert "live-1" not in res.err.splitlines()[-1]  # it loaded phase 1 by itself
        forced = run_cli("rotate", "promote", "--force", "--json", keystore=ring)
        assert forced.code == 0 and forced.json()["forced"] is True
        generation = forced.json()["generation"]
        until(lambda: _presence(ring)["live-1"].generation == generation, 30, "live-1 loads the promote", every=0.1)
        # NEW seals on live-1; the frozen instance never loaded it, but an unknown kid makes it look at the
        # keystore once (reload off notwithstanding: mrtr_keys.codecs.fence) and it opens the round
        token = anyio.run(first_round, live.url).request_state
        assert text_of(anyio.run(retry_round, frozen.url, token)).endswith("(served by frozen)")
        assert text_of(anyio.run(retry_round, live.url, token)).endswith("(served by live-1)")
        until(lambda: _presence(ring)["frozen"].generation == generation, 30, "frozen reports the promote", every=0.1)
        res = run_cli("rotate", "retire", keystore=ring)
        assert res.code == 75 and "frozen" not in res.err  # only the TTL is left to wait for
        events = run_cli("audit", "query", "--op", "promote", "--json", keystore=ring).json()
        assert [e["reason"] for e in events] == ["forced"]


def test_after_a_clean_restart_of_every_instance_promote_is_not_held_by_the_old_names(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert run_cli("init", keystore=ring).code == 0
    with ServerPool(tmp_path / "servers") as pool:
        old = [pool.launch(keystore=ring, extra_args=("--reload-every", "0")) for _ in range(2)]  # named host:pid
        pool.wait_ready()
        assert run_cli("rotate", "begin", keystore=ring).code == 0
        held = run_cli("rotate", "promote", keystore=ring)
        assert held.code == 75 and all(f":{s.proc.pid} (generation 1" in held.err for s in old)
        for s in old:  # a rolling restart: SIGTERM, and the new processes start on the current ring
            pool.stop(s)
            assert s.proc.returncode == -15
        for _ in range(2):
            pool.launch(keystore=ring)
        pool.wait_ready()
        res = run_cli("rotate", "promote", "--json", keystore=ring)
        assert res.code == 0, res.err
        assert res.json()["forced"] is False
        fleet = run_cli("fleet", "status", "--json", keystore=ring).json()
        states = sorted((r["status"], r["generation"] >= 2) for r in fleet)  # the new ones may have the promote
        assert states == [("live", True), ("live", True), ("stopped", False), ("stopped", False)]


def test_a_ring_that_goes_back_is_refused_by_library_codecs_and_sidecars_under_traffic(tmp_path: Path) -> None:
    ring = tmp_path / "ring" / "keyring.json"
    assert run_cli("init", "--ttl", "10", keystore=ring).code == 0
    backup = ring.read_bytes()  # generation 1
    assert run_cli("rotate", "begin", keystore=ring).code == 0
    good = ring.read_bytes()  # generation 2
    other = tmp_path / "other" / "keyring.json"
    create_ring(FileKeystore(other))
    for _ in range(4):
        run_step(FileKeystore(other), "next", force=True)  # another ring, at a higher generation (5)
    secret = run_cli("clients", "add", "driver", "--audience", "provisioner", "--json", keystore=ring).json()["secret"]
    names = ("lib-1", "lib-2", "sc-1", "sc-2")
    with ServerPool(tmp_path / "servers") as pool:
        servers = [pool.launch(keystore=ring, instance=n, extra_args=FAST) for n in names[:2]]
        pool.wait_ready()
        sidecars = [
            start_sidecar(
                ring, workdir=tmp_path / n, reload_interval=2.0, extra=("--instance", n, "--heartbeat-interval", "1")
            )
            for n in names[2:]
        ]
        traffic = Traffic(
            {s.instance: s.url for s in servers}, {n: s.url for n, s in zip(names[2:], sidecars, strict=True)}, secret
        )
        try:
            for n in names:
                traffic.put_in(n)
            traffic.start()
            traffic.wait_rounds(4)

            def write(data: bytes) -> None:  # by hand, as a restore from backup or a wrong copy would
                tmp = ring.with_name("incoming.json")
                tmp.write_bytes(data)
                os.chmod(tmp, 0o600)
                os.replace(tmp, ring)

            for data, says in ((backup, "older than the loaded generation 2"), (other.read_bytes(), "is another ring")):
                write(data)
                until(
                    lambda says=says: all(says in (r.note or "") for n, r in _presence(ring).items() if n in names),
                    30,
                    f"every instance refuses ({says})",
                    every=0.1,
                )
                traffic.wait_rounds(4)
                for s in sidecars:
                    ready = httpx.get(f"{s.url}/readyz", timeout=10, verify=tls.CONTEXT)
                    assert ready.status_code == 200 and says in ready.json()["reload_error"]
                    assert ready.json()["generation"] == 2
            write(good)
            until(
                lambda: all(r.note is None for n, r in _presence(ring).items() if n in names),
                30,
                "the notes clear",
                every=0.1,
            )
            res = run_cli("rotate", "promote", "--wait", "60", "--json", keystore=ring)
            assert res.code == 0 and res.json()["forced"] is False, res.err
            generation = res.json()["generation"]
            until(
                lambda: all(_presence(ring)[n].generation == generation for n in names),
                30,
                "every instance loads the promote",
                every=0.1,
            )
            traffic.wait_rounds(4)
        finally:
            traffic.stop()
            for s in sidecars:
                s.stop()
        assert traffic.rejected == 0 and traffic.failed == 0, "\n".join(traffic.log[:20])
        assert traffic.rounds >= 16
        shutil.rmtree(other.parent)
