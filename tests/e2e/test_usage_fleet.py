"""Fleet-wide seal counts are never below the truth, and at most one reservation block per instance above it,
also after an instance is killed with SIGKILL under traffic (issue 36).

Four real processes share one key ring and one PostgreSQL presence/audit store: two MCP servers built with
`mrtr_keys.request_state_security` (library codecs) and two sidecars. A driver sends multi-round flows (each
retry to another instance than the round that sealed it) and counts, per kid, the seals it saw completed (the
kid is in each token's framing). The store's ``key_usage`` rows are what ``mrtr-keys keys list`` sums; the audit
log's seal events are a second, independent count (exact for what each instance's writer stored).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.audit.writing.stores.base import Query
from mrtr_keys.audit.writing.stores.key_usage import totals
from mrtr_keys.audit.writing.stores.url import open_store
from mrtr_keys.token import b64u_decode
from tests.e2e.servers import ServerPool
from tests.e2e.traffic import Traffic
from tests.fixtures.common import run_cli
from tests.fixtures.sidecar import start_sidecar

pytestmark = pytest.mark.e2e

HEARTBEAT = "2"


def kid_of(token: str) -> str:
    return b64u_decode(token.partition(".")[2])[:4].hex()


@dataclass
class CountingTraffic(Traffic):
    """`Traffic` that also counts, per kid, the seals whose token reached the driver."""

    sealed: Counter[str] = field(default_factory=Counter)
    orphaned: int = 0
    """Sidecar tokens sealed by the surviving sidecar whose second round needed the killed one (their seals count)."""

    def _fail(self, what: str) -> None:
        if what.startswith("no other sidecar instance up"):
            self.orphaned += 1
            return
        super()._fail(what)

    async def _first_rounds(self, turn: int, pending: Any, http: Any, headers: dict[str, str]) -> None:
        before = len(pending)
        await super()._first_rounds(turn, pending, http, headers)
        for _, kind, _, token in list(pending)[before:]:
            self.sealed[kid_of(token if kind == "mcp" else token[0])] += 1


def _fleet_counts(url: str, ring_id: str) -> dict[str, Any]:
    store = open_store(url)
    try:
        rows = store.usage_rows(ring_id)
        audited = dict(store.stats("kid", Query(op="seal", outcome="ok")))
    finally:
        store.close()
    return {"rows": rows, "totals": totals(rows), "audited": audited}


def test_fleet_seal_counts_hold_both_bounds_before_and_after_a_sigkill(tmp_path: Path, postgres_url: str) -> None:
    ring = tmp_path / "ring" / "keyring.json"
    env = {"MRTR_KEYS_AUDIT": postgres_url, "MRTR_KEYS_KEYSTORE": str(ring)}
    assert run_cli("init", "--ttl", "30", keystore=ring, env=env).code == 0
    secret = run_cli("clients", "add", "driver", "--audience", "provisioner", "--json", keystore=ring, env=env)
    assert secret.code == 0, secret.err
    ring_id = run_cli("keys", "list", "--json", keystore=ring, env=env).json()["ring_id"]
    pool = ServerPool(tmp_path / "servers", env=env)
    sidecars: dict[str, Any] = {}
    traffic: CountingTraffic | None = None
    try:
        servers = [
            pool.launch(keystore=ring, instance=n, extra_args=("--ttl", "30", "--heartbeat-every", HEARTBEAT))
            for n in ("mcp-1", "mcp-2")
        ]
        pool.wait_ready()
        for name in ("sc-1", "sc-2"):
            extra = ("--instance", name, "--heartbeat-interval", HEARTBEAT)
            sidecars[name] = start_sidecar(ring, workdir=tmp_path / name, reload_interval=1.0, extra=extra, env=env)
        mcp = {s.instance: s.url for s in servers}
        traffic = CountingTraffic(mcp, {n: s.url for n, s in sidecars.items()}, secret.json()["secret"])
        traffic.hold, traffic.pace = 0.05, 0.05
        for name in (*mcp, *sidecars):
            traffic.put_in(name)
        traffic.start()
        traffic.wait_rounds(100, timeout=120)
        for name in (*mcp, *sidecars):  # a quiet moment: every round the driver started has completed
            traffic.take_out(name)
        _check_bounds("before the kill", traffic.sealed, _fleet_counts(postgres_url, ring_id))
        for name in (*mcp, *sidecars):
            traffic.put_in(name)
        traffic.wait_rounds(50, timeout=120)

        # SIGKILL one sidecar mid-traffic: it writes nothing more, its last reservation stays in the store.
        traffic.take_out("sc-2")
        victim = sidecars["sc-2"]
        victim.proc.kill()
        victim.proc.wait(10)
        traffic.wait_rounds(60, timeout=120)  # the MCP servers go on
        traffic.stop()
        assert traffic.rejected == 0 and traffic.failed == 0, traffic.log[:20]

        completed = traffic.sealed
        assert sum(completed.values()) >= 210 and len(completed) == 1
        (kid,) = completed
        counts = _fleet_counts(postgres_url, ring_id)
        t = _check_bounds("after the kill", completed, counts)
        killed = [r for r in counts["rows"] if r.instance == "sc-2"]
        assert len(killed) == 1 and killed[0].state == "running" and killed[0].seals >= killed[0].sealed
        listed = run_cli("keys", "list", "--json", keystore=ring, env=env).json()["keys"]
        assert [k["seals"] for k in listed if k["kid"] == kid] == [t.seals]
    finally:
        if traffic is not None:
            traffic.stop()
        pool.close()
        for s in sidecars.values():
            s.stop()


def _check_bounds(when: str, completed: Counter[str], counts: dict[str, Any]) -> Any:
    """Never below the truth (every seal a client completed is counted, a killed instance's included; the audit
    log's seal events too), and at most one reservation block per source above it. Both hold at any moment: the
    store holds each block before it is used, and each row's exact part was true when written."""
    ((kid, done),) = completed.items()
    t = counts["totals"][kid]
    print(
        f"\n{when}: completed {done}, fleet {t.seals} (exact part {t.sealed}, reservation blocks {t.blocks}, "
        f"{t.sources} sources), audit log {counts['audited'].get(kid)}"
    )
    assert t.seals >= done and t.seals >= counts["audited"].get(kid, 0), when
    assert t.seals <= done + t.blocks, (when, [r for r in counts["rows"] if r.kid == kid])
    assert all(r.block <= 2**47 // 100 for r in counts["rows"]), when  # <= 1 % of the budget
    return t
