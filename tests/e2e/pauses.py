"""Driving a fleet past a paused instance: rotation steps through the CLI, SIGSTOP / SIGCONT, the gates' view.

Shared by tests/e2e/test_paused_instance.py and the benchmark's paused-instance rows (bench/fleet_paused.py),
so both pause, step and wait the same way. Every CLI call is ``mrtr-keys ... --json`` in its own process
(`tests.fixtures.common.run_cli`), as a deploy pipeline would run it.

    secret = init_ring(ring, env, ttl="10")
    freeze(proc)                      # SIGSTOP: the process keeps its ring and its lease clock keeps counting
    rotate(ring, env, "next", "--wait", "60")
    retire_once_only_time_is_left(ring, env)
    thaw(proc)                        # SIGCONT
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from tests.e2e.servers import ServerPool
from tests.fixtures.common import run_cli
from tests.fixtures.sidecar import Sidecar, start_sidecar


def init_ring(ring: str, env: dict[str, str], *, ttl: str) -> str:
    """``mrtr-keys init --ttl TTL`` at `ring` and one client ``driver`` for audience ``provisioner``; its secret."""
    assert run_cli("init", "--ttl", ttl, keystore=ring, env=env).code == 0
    res = run_cli("clients", "add", "driver", "--audience", "provisioner", "--json", keystore=ring, env=env)
    assert res.code == 0, res.err
    return str(res.json()["secret"])


def start_sidecar_instance(
    ring: str, env: dict[str, str], tmp: Path, name: str, *extra: str, heartbeat: str, reload: float
) -> Sidecar:
    """``mrtr-keys serve`` as instance `name`, beating every `heartbeat` s and checking the ring every `reload` s."""
    args = ("--instance", name, "--heartbeat-interval", heartbeat, *extra)
    return start_sidecar(ring, workdir=tmp / name, reload_interval=reload, extra=args, env=env)


def mcp_server_args(*, ttl: str, heartbeat: str, reload: str) -> tuple[str, ...]:
    """The example MCP server's flags for a fleet member (token TTL, heartbeat and ring check in seconds)."""
    return ("--ttl", ttl, "--heartbeat-every", heartbeat, "--reload-every", reload)


def start_mcp_servers(
    pool: ServerPool,
    ring: str,
    *names: str,
    ttl: str,
    heartbeat: str,
    reload: str,
    env_of: dict[str, dict[str, str]] | None = None,
) -> list[Any]:
    """Example MCP servers on `ring` named `names` (`env_of[name]`: extra environment), once all are ready."""
    extra = mcp_server_args(ttl=ttl, heartbeat=heartbeat, reload=reload)
    env_of = env_of or {}
    servers = [pool.launch(keystore=ring, instance=n, extra_args=extra, env=env_of.get(n)) for n in names]
    pool.wait_ready()
    return servers


def rotate(ring: str, env: dict[str, str], *args: str) -> dict[str, Any]:
    """``mrtr-keys rotate ARGS --json``; asserts exit 0 and returns its JSON."""
    res = run_cli("rotate", *args, "--json", keystore=ring, env=env, timeout=120)
    assert res.code == 0, res.err + res.out
    doc: dict[str, Any] = res.json()
    return doc


def wait_stale(ring: str, env: dict[str, str], name: str, timeout: float = 20) -> None:
    """Until `fleet status` shows `name` stale: the gates no longer count it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = run_cli("fleet", "status", "--json", keystore=ring, env=env).json()
        if any(r["name"] == name and r["status"] == "stale" for r in rows):
            return
        time.sleep(0.2)
    raise AssertionError(f"{name} never went stale")


def wait_settled(ring: str, env: dict[str, str], timeout: float = 30) -> None:
    """Until `rotate status` shows every live instance on the current generation."""
    deadline = time.monotonic() + timeout
    while True:
        st = rotate(ring, env, "status")
        if st["instances_ready"] == st["instances_live"]:
            return
        assert time.monotonic() < deadline, st
        time.sleep(0.2)


def retire_once_only_time_is_left(ring: str, env: dict[str, str], *, hold: float = 1.0) -> dict[str, Any]:
    """`rotate retire --force` once `rotate status` waits for the TTL alone (every live instance loaded the
    promote; a stale one is not counted) and a held token's time has passed: forcing skips TTL + 60 s only.

    `hold`: seconds slept after that, for tokens sealed with the old key before every instance loaded the
    promote (the traffic holds them 0.3 s)."""
    deadline = time.monotonic() + 30
    while True:
        st = rotate(ring, env, "status")
        if [w["for"] for w in st["waits"]] == ["TTL"] and st["instances_ready"] == st["instances_live"]:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    time.sleep(hold)
    return rotate(ring, env, "retire", "--force")


def freeze(proc: Any) -> None:
    """SIGSTOP `proc`: it keeps its ring, sends nothing, and its monotonic clock keeps counting."""
    proc.send_signal(signal.SIGSTOP)


def thaw(proc: Any) -> None:
    """SIGCONT `proc`."""
    proc.send_signal(signal.SIGCONT)
