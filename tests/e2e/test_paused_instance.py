"""A paused instance wakes up fenced: it looks at the keystore before it serves (issue 23).

Real processes share one key ring and one PostgreSQL audit store: three MCP servers built with
`mrtr_keys.request_state_security` and three sidecars, heartbeats every 0.5 s (so the gates stop counting a
silent instance after 1.5 s, and the self-fencing lease is 1.5 s). A driver sends multi-round flows
continuously, each retry to another instance than the first round (`tests.e2e.traffic`).

Over `vault-kv://` (OpenBao) and `aws-sm://` (moto); the control over a ring file.

* **Paused across a promote**: ``mcp-3`` is frozen with SIGSTOP before ``begin``; ``rotate next --wait``
  promotes once it is stale (it never loaded the new key); it is resumed after the promote and put back in
  traffic at once, where it meets tokens sealed with a key it never saw.
* **Paused at phase 1 across a retire**: ``sc-2`` has loaded ``begin`` and is frozen; ``promote`` goes on
  (it had the new key), the gates stop counting it, and ``retire`` follows (forced only past the TTL + 60 s
  time gate, once ``rotate status`` shows nothing else to wait for and no old-key token is in flight); it
  is resumed and sealing at once, on a ring whose primary the fleet has retired.

0 rejected rounds. `sc-2` checks the keystore only every 60 s (SIGHUP loads phase 1), so the wake-up does
not coincide with a background check: only the lease makes it look. The control runs the same
paused-at-phase-1 sidecar with ``--lease 0``, and must reject.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from tests.e2e.pauses import (
    freeze,
    init_ring,
    retire_once_only_time_is_left,
    rotate,
    start_mcp_servers,
    start_sidecar_instance,
    thaw,
    wait_stale,
)
from tests.e2e.servers import ServerPool
from tests.e2e.traffic import Traffic
from tests.fixtures.common import run_cli
from tests.fixtures.faults import through
from tests.fixtures.moto_kms import AWS_ENV
from tests.fixtures.openbao import OpenBao
from tests.fixtures.sidecar import Sidecar
from tests.support.proxy import CountingProxy

pytestmark = pytest.mark.e2e

HEARTBEAT = "0.5"
TTL = "10"


@pytest.fixture(params=["vault-kv", "aws-sm"])
def shared_ring(request: pytest.FixtureRequest, tmp_path: Path, postgres_url: str) -> tuple[str, dict[str, str]]:
    """(the ring's location, the fleet's environment): a Vault KV v2 secret in OpenBao or a Secrets Manager
    secret in moto, with one state directory (client registry, audit key) for the fleet; presence in
    PostgreSQL. (A ring file is the control's keystore, and tests/e2e/test_fleet_rotation.py's.)"""
    env = {"MRTR_KEYS_AUDIT": postgres_url}
    if request.param == "vault-kv":
        bao: OpenBao = request.getfixturevalue("openbao")
        ring = f"vault-kv://secret/paused/{tmp_path.name}"
        env.update({**bao.env(), "MRTR_KEYS_STATE_DIR": str(tmp_path / "state")})
    else:
        moto: str = request.getfixturevalue("moto_server")
        ring = f"aws-sm://paused/{tmp_path.name}"
        env.update({**AWS_ENV, "AWS_ENDPOINT_URL": moto, "MRTR_KEYS_STATE_DIR": str(tmp_path / "state")})
    env["MRTR_KEYS_KEYSTORE"] = ring
    return ring, env


def _init(shared_ring: tuple[str, dict[str, str]]) -> tuple[str, dict[str, str], str]:
    ring, env = shared_ring
    return ring, env, init_ring(ring, env, ttl=TTL)


def _sidecar(ring: str, env: dict[str, str], tmp: Path, name: str, *extra: str, reload: float = 0.5) -> Sidecar:
    return start_sidecar_instance(ring, env, tmp, name, *extra, heartbeat=HEARTBEAT, reload=reload)


def _mcp_servers(pool: ServerPool, ring: str, *names: str) -> list[Any]:
    """MCP servers on the ring (heartbeat and reload every 0.5 s), once all are ready."""
    return start_mcp_servers(pool, ring, *names, ttl=TTL, heartbeat=HEARTBEAT, reload="0.5")


def test_instances_paused_across_a_promote_and_a_retire_reject_nothing(
    tmp_path: Path, shared_ring: tuple[str, dict[str, str]]
) -> None:
    ring, env, secret = _init(shared_ring)
    pool = ServerPool(tmp_path / "servers", env=env)
    sidecars: list[Sidecar] = []
    traffic: Traffic | None = None
    try:
        servers = _mcp_servers(pool, ring, *("mcp-1", "mcp-2", "mcp-3"))
        sidecars = [
            _sidecar(ring, env, tmp_path, "sc-1"),
            _sidecar(ring, env, tmp_path, "sc-2", reload=60),
            _sidecar(ring, env, tmp_path, "sc-3"),
        ]
        traffic = Traffic(
            {s.instance: s.url for s in servers}, {f"sc-{i}": s.url for i, s in enumerate(sidecars, 1)}, secret
        )
        for name in ("mcp-1", "mcp-2", "mcp-3", "sc-1", "sc-2", "sc-3"):
            traffic.put_in(name)
        traffic.start()
        traffic.wait_rounds(6)
        waits: dict[str, float] = {}

        # 1. mcp-3 frozen before begin, resumed after the promote
        paused = servers[2]
        traffic.take_out("mcp-3")
        freeze(paused.proc)
        frozen = time.monotonic()
        began = rotate(ring, env, "next", "--wait", "60")
        assert began["step"] == "begin"
        sidecars[1].proc.send_signal(signal.SIGHUP)  # sc-2 checks only every 60 s: load phase 1 now
        started = time.monotonic()
        assert rotate(ring, env, "next", "--wait", "60")["step"] == "promote"  # once mcp-3 is stale
        waits["promote"] = round(time.monotonic() - started, 1)
        waits["promote_after_freeze"] = round(time.monotonic() - frozen, 1)
        traffic.wait_rounds(4)  # the new key seals on the others
        thaw(paused.proc)
        traffic.put_in("mcp-3")
        traffic.wait_rounds(6, involving="mcp-3")
        retire_once_only_time_is_left(ring, env)

        # 2. sc-2 on phase 1 (began) frozen across promote and retire
        began = rotate(ring, env, "next", "--wait", "60")
        assert began["step"] == "begin"
        sidecars[1].proc.send_signal(signal.SIGHUP)
        sidecars[1].wait_generation(secret, began["generation"])
        traffic.take_out("sc-2")
        freeze(sidecars[1].proc)
        assert rotate(ring, env, "next", "--wait", "60")["step"] == "promote"  # sc-2 had the new key
        wait_stale(ring, env, "sc-2")
        retire_once_only_time_is_left(ring, env)
        thaw(sidecars[1].proc)
        traffic.put_in("sc-2")
        traffic.wait_rounds(6, involving="sc-2")
        traffic.wait_rounds(6, involving="mcp-3")
        traffic.stop()
        assert traffic.rejected == 0 and traffic.failed == 0, "\n".join(traffic.log[:20])
        summary = {"rounds": traffic.rounds, "rejected": traffic.rejected, "failed": traffic.failed, "waits": waits}
        print(f"\npaused instances over {ring.split(':')[0] if '://' in ring else 'file'}: {json.dumps(summary)}")
        # the promote waited for mcp-3 to go stale: its last heartbeat was at most 0.5 s before the freeze and an
        # instance is stale 1.5 s after it (on a loaded host `begin` alone may take that long, so the wait is
        # counted from the freeze)
        assert waits["promote_after_freeze"] >= 1.0, waits
    finally:
        if traffic is not None:
            traffic.stop()
        for s in servers if "servers" in locals() else []:
            if s.proc.poll() is None:
                thaw(s.proc)
        for sc in sidecars:
            if sc.proc.poll() is None:
                thaw(sc.proc)
            sc.stop()
        pool.close()


def test_control_without_the_lease_a_paused_sidecar_seals_with_a_retired_kid(tmp_path: Path, postgres_url: str) -> None:
    ring = str(tmp_path / "ring" / "keyring.json")
    ring, env, secret = _init((ring, {"MRTR_KEYS_AUDIT": postgres_url, "MRTR_KEYS_KEYSTORE": ring}))
    sidecars = [
        _sidecar(ring, env, tmp_path, "sc-1"),
        _sidecar(ring, env, tmp_path, "sc-2", "--lease", "0", reload=60),
        _sidecar(ring, env, tmp_path, "sc-3"),
    ]
    traffic = Traffic({}, {f"sc-{i}": s.url for i, s in enumerate(sidecars, 1)}, secret)
    try:
        for name in ("sc-1", "sc-2", "sc-3"):
            traffic.put_in(name)
        traffic.start()
        traffic.wait_rounds(4)
        began = rotate(ring, env, "next", "--wait", "60")
        sidecars[1].proc.send_signal(signal.SIGHUP)
        sidecars[1].wait_generation(secret, began["generation"])
        traffic.take_out("sc-2")
        freeze(sidecars[1].proc)
        assert rotate(ring, env, "next", "--wait", "60")["step"] == "promote"
        wait_stale(ring, env, "sc-2")
        retire_once_only_time_is_left(ring, env)
        thaw(sidecars[1].proc)
        traffic.put_in("sc-2")
        deadline = time.monotonic() + 20
        while traffic.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        traffic.stop()
        assert traffic.rejected > 0, traffic.summary()
        rejected = [line for line in traffic.log if "REJECTED" in line]
        assert rejected and all("sealed by sc-2" in line for line in rejected), traffic.log  # sealed after waking
        assert "retired kid" in sidecars[0].output() + sidecars[2].output()
        print(f"\ncontrol (lease off): {traffic.summary()}")
    finally:
        traffic.stop()
        for sc in sidecars:
            if sc.proc.poll() is None:
                thaw(sc.proc)
            sc.stop()


CUT_SECONDS = 40.0
"""How long `sc-cut` is cut from its keystore and its audit store (issue 23: a partition, not a pause)."""


def test_an_instance_cut_from_keystore_and_audit_store_for_40_s_rejects_nothing_once_healed(
    tmp_path: Path, shared_ring: tuple[str, dict[str, str]], postgres_url: str
) -> None:
    """``sc-cut`` reaches the keystore (OpenBao or moto) and the PostgreSQL audit store through proxies that
    blackhole for 40 s (connections held, nothing answered) while the fleet begins and promotes a rotation
    without it (its heartbeats stop arriving, so the gates stop counting it). It is out of traffic while cut,
    as a load balancer would take out an instance failing its readiness; healed, it is put back at once, and
    meets tokens sealed with a key it never saw: 0 rejected, and it reports the new generation."""
    ring, env, secret = _init(shared_ring)
    store = CountingProxy(int(urlparse(postgres_url).port or 5432), http=False)
    if ring.startswith("vault-kv://"):
        keystore = CountingProxy(int(env["BAO_ADDR"].rsplit(":", 1)[1]))
        cut_env = {**env, "BAO_ADDR": keystore.url, "VAULT_ADDR": keystore.url}
    else:
        keystore = CountingProxy(int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
        cut_env = {**env, "AWS_ENDPOINT_URL": keystore.url}
    cut_env["MRTR_KEYS_AUDIT"] = through(postgres_url, store)
    pool = ServerPool(tmp_path / "servers", env=env)
    sidecars: list[Sidecar] = []
    traffic: Traffic | None = None
    try:
        servers = _mcp_servers(pool, ring, *("mcp-1", "mcp-2"))
        sidecars = [_sidecar(ring, env, tmp_path, "sc-1"), _sidecar(ring, cut_env, tmp_path, "sc-cut")]
        traffic = Traffic(
            {s.instance: s.url for s in servers}, {"sc-1": sidecars[0].url, "sc-cut": sidecars[1].url}, secret
        )
        for name in ("mcp-1", "mcp-2", "sc-1", "sc-cut"):
            traffic.put_in(name)
        traffic.start()
        traffic.wait_rounds(6, involving="sc-cut")

        traffic.take_out("sc-cut")
        keystore.faults.blackhole()
        store.faults.blackhole()
        cut = time.monotonic()
        assert rotate(ring, env, "next", "--wait", "60")["step"] == "begin"
        promoted = rotate(ring, env, "next", "--wait", "60")  # once sc-cut is stale: its heartbeats are held
        assert promoted["step"] == "promote"
        traffic.wait_rounds(6)  # the new key seals on the others
        rows = {r["name"]: r for r in run_cli("fleet", "status", "--json", keystore=ring, env=env).json()}
        assert rows["sc-cut"]["status"] == "stale", rows["sc-cut"]
        time.sleep(max(0.0, cut + CUT_SECONDS - time.monotonic()))
        keystore.faults.restore()
        store.faults.restore()
        traffic.put_in("sc-cut")  # at once: its first call finds the lease run out and looks first
        traffic.wait_rounds(8, involving="sc-cut")
        traffic.stop()
        assert traffic.rejected == 0 and traffic.failed == 0, "\n".join(traffic.log[:20])
        assert sidecars[1].generation(secret) == promoted["generation"]
        print(f"\ncut {CUT_SECONDS:g} s over {ring.split(':')[0]}: {traffic.summary()}")
    finally:
        if traffic is not None:
            traffic.stop()
        keystore.faults.restore()
        store.faults.restore()
        for sc in sidecars:
            sc.stop()
        pool.close()
        keystore.close()
        store.close()
