"""The ``fleet`` part's paused instances (issue 23): rejected rounds with one instance paused 20 s across each phase.

The fleet and the moves are the paused-instance test's (tests/e2e/test_paused_instance.py, through the same
helpers, `tests.e2e.pauses`): three example MCP servers (the library codec, `mrtr_keys.request_state_security`)
and three sidecars share one ``vault-kv://`` ring in OpenBao and one SQLite presence/audit store, with the
product's ring check every 2 s and heartbeats every 2 s (so the gates stop counting a silent instance after
6 s, and the self-fencing lease is 6 s). `tests.e2e.traffic.Traffic` sends multi-round flows continuously
(two a second of each kind, held 0.3 s), the retry always on another instance than round 1.

For each phase P of begin, promote, retire, one instance is taken out of traffic and frozen (SIGSTOP) just
before step P is written. The fleet then makes step P and the one after it (after a retire: the next
rotation's begin and promote) as soon as the gates allow: ``rotate next --wait``, a retire forced only past
its TTL + 60 s time gate once ``rotate status`` waits for nothing else, as in the test. The instance is
resumed (SIGCONT) 20 s after the freeze, put back in traffic at once, and the phase ends after 6 flows
through it. So each wakes on a ring the fleet has moved past:

* across begin (``mcp-3``): it missed begin and promote, and meets tokens of a key it never saw;
* across promote (``sc-2``, on phase 1): the fleet promoted and retired its primary;
* across retire (``mcp-2``): it missed the retire and the next begin and promote.

Reported per phase: rejected rounds (target 0), rounds, failures, the wait of each step, and the paused
instance's keystore requests from its freeze to the end of the phase (it sends none while frozen), counted at
a proxy in front of OpenBao that only it uses: cheap checks (KV metadata) and full reads (KV data).

With ``--quick`` (the smoke test): three sidecars only, heartbeats and checks every 0.5 s, a 3 s pause and 3
flows after it (the steps may outlast the pause; the row says how long it was).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e import pauses
from tests.e2e.servers import ServerPool
from tests.e2e.traffic import Traffic

from bench.common import Settings
from bench.report import Row
from bench.services import Services

PART = "fleet"
STEPS = ("begin", "promote", "retire")
PAUSE = 20.0
TTL = "10"
PAUSED = {"begin": "mcp-3", "promote": "sc-2", "retire": "mcp-2"}
QUICK_PAUSED = {"begin": "sc-3", "promote": "sc-2", "retire": "sc-1"}


@dataclass
class Phase:
    """What one paused phase saw."""

    step: str
    instance: str
    paused: float = 0.0
    rounds: int = 0
    rejected: int = 0
    failed: int = 0
    waits: dict[str, float] = field(default_factory=dict)
    keystore: Counter[str] = field(default_factory=Counter)


def kv_request(head: bytes) -> str:
    """`CountingProxy` key of a Vault request: ``check`` (KV metadata), ``read`` (KV data) or ``other``."""
    line = head.split(b"\r\n", 1)[0]
    if b"/metadata/" in line:
        return "check"
    if b"/data/" in line:
        return "read"
    return "other"


def _span(step: str) -> tuple[str, ...]:
    """The steps the fleet makes while an instance is paused across `step`."""
    return ("retire", "begin", "promote") if step == "retire" else (step, STEPS[STEPS.index(step) + 1])


def _advance(ring: str, env: dict[str, str], step: str) -> float:
    """Make `step` as soon as the gates allow; its wait in seconds."""
    started = time.monotonic()
    if step == "retire":
        pauses.retire_once_only_time_is_left(ring, env)
    else:
        made = pauses.rotate(ring, env, "next", "--wait", "60")["step"]
        assert made == step, (made, step)
    return round(time.monotonic() - started, 1)


def _paused_phase(
    member: Any,
    name: str,
    traffic: Traffic,
    proxy: Any,
    at: tuple[str, dict[str, str]],
    step: str,
    pause: float,
    n: int,
) -> Phase:
    """Freeze `member` (instance `name`) before `step`, make the steps of `_span`, thaw it after `pause` s,
    and count until `n` flows went through it. `at`: the ring and the CLI's environment."""
    ring, env = at
    phase = Phase(step, name)
    before = (traffic.rounds, traffic.rejected, traffic.failed)
    pauses.wait_settled(ring, env)  # it froze on the generation the fleet is at
    traffic.take_out(name)
    proxy.reset()
    pauses.freeze(member.proc)
    frozen = time.monotonic()
    try:
        for made in _span(step):
            phase.waits[made] = _advance(ring, env, made)
        time.sleep(max(0.0, frozen + pause - time.monotonic()))
    finally:
        pauses.thaw(member.proc)
    phase.paused = round(time.monotonic() - frozen, 1)
    traffic.put_in(name)
    traffic.wait_rounds(n, involving=name)
    phase.rounds, phase.rejected, phase.failed = (
        now - then for now, then in zip((traffic.rounds, traffic.rejected, traffic.failed), before, strict=True)
    )
    phase.keystore = Counter(proxy.calls)
    return phase


def run_phases(services: Services, settings: Settings) -> tuple[list[Phase], Traffic]:
    """Start the fleet, pause one instance across each phase, stop everything; the phases and the traffic."""
    quick = settings.quick
    pause, beat, check, n = (3.0, "0.5", 0.5, 3) if quick else (PAUSE, "2", 2.0, 6)
    work = Path(services.workdir) / "fleet-paused"
    bao = services.bao
    ring = "vault-kv://secret/bench/paused"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRTR_KEYS_")}
    env.update(bao.env(), MRTR_KEYS_STATE_DIR=str(work / "state"), MRTR_KEYS_KEYSTORE=ring)
    env["MRTR_KEYS_AUDIT"] = "sqlite:///" + str(work / "audit.db").lstrip("/")
    secret = pauses.init_ring(ring, env, ttl=TTL)
    mcp_names = () if quick else ("mcp-1", "mcp-2", "mcp-3")
    proxies = {name: services.proxy(bao.port, classify=kv_request) for name in (*mcp_names, "sc-1", "sc-2", "sc-3")}
    own = {name: {**env, "BAO_ADDR": p.url, "VAULT_ADDR": p.url} for name, p in proxies.items()}
    pool = ServerPool(work / "servers", env=env)
    fleet: dict[str, Any] = {}
    traffic: Traffic | None = None
    try:
        timing = {"ttl": TTL, "heartbeat": beat, "reload": str(check)}
        servers = pauses.start_mcp_servers(pool, ring, *mcp_names, **timing, env_of=own)
        fleet.update({s.instance: s for s in servers})
        for name in ("sc-1", "sc-2", "sc-3"):
            fleet[name] = pauses.start_sidecar_instance(ring, own[name], work, name, heartbeat=beat, reload=check)
        sidecars = {name: fleet[name].url for name in ("sc-1", "sc-2", "sc-3")}
        traffic = Traffic({s.instance: s.url for s in servers}, sidecars, secret)
        for name in fleet:
            traffic.put_in(name)
        traffic.start()
        traffic.wait_rounds(6)
        phases: list[Phase] = []
        following = "begin"
        for step in STEPS:
            while following != step:
                _advance(ring, env, following)
                following = STEPS[(STEPS.index(following) + 1) % 3]
            name = (QUICK_PAUSED if quick else PAUSED)[step]
            phases.append(_paused_phase(fleet[name], name, traffic, proxies[name], (ring, env), step, pause, n))
            following = STEPS[(STEPS.index(_span(step)[-1]) + 1) % 3]
        traffic.stop()
        return phases, traffic
    finally:
        if traffic is not None:
            traffic.stop()
        for member in fleet.values():
            if member.proc.poll() is None:
                pauses.thaw(member.proc)
            if hasattr(member, "stop"):
                member.stop()
        pool.close()


def run(services: Services, settings: Settings) -> list[Row]:
    phases, traffic = run_phases(services, settings)
    rows = []
    for p in phases:
        waits = ", ".join(f"{step} {seconds:g} s" for step, seconds in p.waits.items())
        kind = "sidecar" if p.instance.startswith("sc-") else "library MCP server"
        note = (
            f"{p.instance} ({kind}) paused {p.paused:g} s; {p.rounds} rounds, {p.failed} failed; waits: {waits}; "
            f"its keystore requests after waking: {p.keystore['check']} checks, {p.keystore['read']} full read(s)"
        )
        if p.keystore["other"]:
            note += f", {p.keystore['other']} other"
        name = f"rejected rounds, one instance paused across {p.step}"
        rows.append(Row(PART, name, "rounds", float(p.rejected), note=note).decide(float(p.rejected), "== 0 rounds"))
    if traffic.failed or traffic.rejected:
        rows[-1].note += "; first refusals: " + " | ".join(traffic.log[:3])[:300]
    return rows
