"""Adopting mrtr-keys in a fleet on the MCP SDK's own ``RequestStateSecurity(keys=[KEY])`` with a rolling
deploy, without dropping a round (docs/migration.md).

Real MCP servers over streamable HTTP (``python -m mrtr_keys.example``, uvicorn, free loopback ports), all
named ``provisioner``: A runs the SDK's own codec with KEY (``--sdk-key-file``), B and later C run
``mrtr_keys.request_state_security(ring)`` over a ring started from KEY (``mrtr-keys init
--from-sdk-key-file``). Every round is served first by one process and completed by another.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import anyio
import pytest
from mcp.shared.exceptions import MCPError

from mrtr_keys.codecs.sdk_v1 import sdk_kid
from tests.e2e.fleet import INVALID_REQUEST_STATE
from tests.e2e.servers import ExampleServer, ServerPool, first_round, retry_round, text_of
from tests.fixtures.common import CliResult, run_cli

pytestmark = pytest.mark.e2e

AUDIENCE = "provisioner"
TTL = "30"  # ring and servers: a v1. token minted before promote is still unexpired when retire comes


class Migration:
    """The servers, the ring and a tally of every round: (phase, first server, second server, token format)."""

    def __init__(self, ring: Path, pool: ServerPool) -> None:
        self.ring, self.pool = ring, pool
        self.rounds: Counter[tuple[str, str]] = Counter()
        self.n = 0

    def cli(self, *args: str) -> CliResult:
        r = run_cli(*args, keystore=self.ring)
        assert r.code == 0, (args, r.code, r.out, r.err)
        return r

    def server(self, instance: str) -> ExampleServer:
        extra = ("--ttl", TTL, "--reload-every", "0.2")
        return self.pool.launch(keystore=self.ring, audience=AUDIENCE, instance=instance, extra_args=extra)

    def cross(self, phase: str, first: ExampleServer, second: ExampleServer) -> str:
        """One round first served by `first`, completed by `second`; returns the token and tallies it."""
        self.n += 1
        name = f"db{self.n}"

        async def go() -> tuple[str, str]:
            token = (await first_round(first.url, name)).request_state or ""
            return token, text_of(await retry_round(second.url, token, "eu-west-1", name))

        token, text = anyio.run(go)
        assert text == f"Provisioned '{name}' in eu-west-1. (served by {second.instance})", (phase, token[:8])
        self.rounds[(phase, token.split(".")[0])] += 1
        return token

    def both_ways(self, phase: str, x: ExampleServer, y: ExampleServer, times: int = 2) -> list[str]:
        return [self.cross(phase, a, b) for _ in range(times) for a, b in ((x, y), (y, x))]

    def mint(self, server: ExampleServer, name: str) -> str:
        return anyio.run(first_round, server.url, name).request_state or ""

    def refused(self, server: ExampleServer, token: str, name: str) -> None:
        with pytest.raises(MCPError) as info:
            anyio.run(retry_round, server.url, token, "eu-west-1", name)
        assert (info.value.code, info.value.message) == INVALID_REQUEST_STATE

    def wait_loaded(self, generation: int, servers: int = 2) -> None:
        """Until `servers` ring instances have loaded `generation`, as their ``ring-loaded`` audit events say
        (`mrtr-keys audit query --op ring-loaded`; the servers check the ring every 0.2 s)."""
        deadline = time.monotonic() + 30
        while True:
            events = self.cli("audit", "query", "--op", "ring-loaded", "--json").json()
            if len({e["instance"] for e in events if (e["generation"] or 0) >= generation}) >= servers:
                return
            assert time.monotonic() < deadline, f"{servers} instances did not load generation {generation}"
            time.sleep(0.2)

    def fleet(self, generation: int) -> dict[str, dict[str, object]]:
        """`mrtr-keys fleet status --json` by instance name, once B and C report `generation` (bounded)."""
        deadline = time.monotonic() + 30
        while True:
            rows = {r["name"]: r for r in self.cli("fleet", "status", "--json").json() if r["status"] == "live"}
            if {"B", "C"} <= set(rows) and all(rows[n]["generation"] == generation for n in ("B", "C")):
                return rows
            assert time.monotonic() < deadline, rows
            time.sleep(0.3)

    def step_when_gates_allow(self, step: str) -> CliResult:
        """``mrtr-keys rotate STEP``, repeated while it exits 75 (a gate: an instance has not loaded phase 1)."""
        deadline = time.monotonic() + 30
        while True:
            r = run_cli("rotate", step, "--json", keystore=self.ring)
            if r.code == 0:
                return r
            assert r.code == 75 and time.monotonic() < deadline, (r.code, r.err)
            time.sleep(0.3)


def test_a_fleet_on_the_sdks_key_moves_to_mrtr_keys_and_rotates_out_without_dropping_a_round(tmp_path: Path) -> None:
    key = os.urandom(48)  # the SDK takes any secret of at least 32 bytes
    key_file = tmp_path / "sdk.key"
    key_file.write_bytes(key)
    key_file.chmod(0o600)
    ring = tmp_path / "ring" / "keyring.json"
    init = run_cli(
        "init", "--from-sdk-key-file", str(key_file), "--ttl", TTL, "--audience", AUDIENCE, "--json", keystore=ring
    )
    assert init.code == 0, init.err
    kid = init.json()["kid"]
    assert kid == sdk_kid(key) and init.json()["format"] == "sdk-v1"

    with ServerPool(tmp_path / "logs") as pool:
        m = Migration(ring, pool)
        a = pool.launch(keystore=None, audience=AUDIENCE, instance="A", key_args=("--sdk-key-file", str(key_file)))
        b = m.server("B")
        pool.wait_ready()

        # Phase 0: A still on the SDK's codec, B on mrtr-keys; rounds cross in both directions as v1. tokens.
        tokens = m.both_ways("0-mixed", a, b)
        for token in tokens[:2]:  # one minted by A (the SDK), one by B (the ring)
            shown = m.cli("inspect", token, "--json").json()
            assert (shown["format"], shown["kid"], shown["state"], shown["key_format"]) == (
                "v1",
                kid,
                "primary",
                "sdk-v1",
            )

        listed = m.cli("keys", "list").out
        assert [line.split()[:3] for line in listed.splitlines() if line.startswith(kid)] == [[kid, "primary", "sdk"]]
        assert "sdk-v1" in m.cli("keys", "list", "--wide").out

        # The rolling deploy replaces A with C, a second ring instance.
        pool.stop(a)
        c = m.server("C")
        pool.wait_ready()
        m.both_ways("0-ring", b, c)
        fleet = m.fleet(1)
        assert [(fleet[n]["primary_kid"], fleet[n]["primary_format"]) for n in ("B", "C")] == [(kid, "sdk-v1")] * 2
        assert f"{kid}: the MCP SDK's own key" in m.cli("fleet", "status").out

        # Phase 1: a new mk2 key every instance learns; the SDK key still seals.
        began = m.cli("rotate", "begin", "--json").json()
        new_kid = began["new"]
        m.wait_loaded(began["generation"])
        loaded = m.cli("audit", "query", "--op", "ring-loaded", "--json").json()
        assert {e["generation"] for e in loaded} == {1, began["generation"]}
        ring_instances = {e["instance"] for e in loaded}
        assert len(ring_instances) == 2  # B and C (A, on the SDK's own codec, writes no audit events)
        m.both_ways("1-begun", b, c)
        before_promote = {s.instance: m.mint(s, f"pre-{s.instance}") for s in (b, c)}
        assert all(t.startswith("v1.") for t in before_promote.values())

        # Phase 2: the mk2 key seals (the promote gate reads the audit log: both instances loaded phase 1).
        promoted = m.step_when_gates_allow("promote").json()
        m.wait_loaded(promoted["generation"])
        fleet = m.fleet(promoted["generation"])
        assert {(r["primary_kid"], r["primary_format"]) for r in fleet.values()} == {(new_kid, "mk2")}
        new_tokens = m.both_ways("2-promoted", b, c)
        assert all(t.startswith("mk2.") for t in new_tokens)
        assert m.cli("inspect", new_tokens[0], "--json").json()["kid"] == new_kid
        for minted_on, other in (("B", c), ("C", b)):  # v1. tokens minted before the promote still complete
            text = text_of(
                anyio.run(retry_round, other.url, before_promote[minted_on], "eu-west-1", f"pre-{minted_on}")
            )
            assert text.endswith(f"(served by {other.instance})")
            m.rounds[("2-promoted", "v1-before-promote")] += 1
        assert m.cli("inspect", before_promote["B"], "--json").json()["state"] == "verify"

        # Phase 3: retire. Before promote + TTL + 60 s the time gate refuses (exit 75); forced, it retires
        # the SDK key, and the v1. tokens (unexpired) are refused from then on: reason "retired kid".
        early = run_cli("rotate", "retire", keystore=ring)
        assert early.code == 75 and "waiting" in early.err, (early.code, early.err)
        retired = m.cli("rotate", "retire", "--force", "--json").json()
        assert retired["old"] == kid
        m.wait_loaded(retired["generation"])
        for minted_on, other in (("B", c), ("C", b)):
            m.refused(other, before_promote[minted_on], f"pre-{minted_on}")
        for s in (b, c):
            assert "requestState rejected on tools/call: retired kid" in s.output()
        deadline = time.monotonic() + 15  # each server's audit writer ships within its longest wait
        while True:  # (docs/audit.md, "Deadlines"): the refusals are on record shortly after they happen
            refusals = m.cli("audit", "query", "--kid", kid, "--outcome", "rejected", "--json").json()
            if len(refusals) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [e["reason"] for e in refusals] == ["retired kid", "retired kid"]
        assert len({e["instance"] for e in refusals}) == 2
        destroyed = m.cli("keys", "destroy", kid).out
        assert f"key {kid} destroyed" in destroyed
        m.wait_loaded(retired["generation"] + 1)
        m.refused(b, before_promote["C"], "pre-C")
        final = m.both_ways("3-retired", b, c)
        assert all(t.startswith("mk2.") for t in final)

        # The audit log: the init is marked as the SDK format; seals by kid show the move.
        init_events = m.cli("audit", "query", "--op", "init", "--json").json()
        assert [(e["kid"], e["reason"]) for e in init_events] == [(kid, "sdk-v1")]
        deadline = time.monotonic() + 15  # the last round's seals are on record within the writer's longest wait
        while True:
            stats = m.cli("audit", "stats", "--by", "kid", "--op", "seal", "--since", "5m", "--json").json()
            sealed = {row["key"]: row["count"] for row in stats}
            if (sealed.get(kid, 0) >= 6 and sealed.get(new_kid, 0) >= 8) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        instances = m.cli("audit", "stats", "--by", "instance", "--json").json()
        assert ring_instances <= {row["key"] for row in instances}
        assert sealed[kid] >= 6 and sealed[new_kid] >= 8

    assert m.rounds == {
        ("0-mixed", "v1"): 4,
        ("0-ring", "v1"): 4,
        ("1-begun", "v1"): 4,
        ("2-promoted", "mk2"): 4,
        ("2-promoted", "v1-before-promote"): 2,
        ("3-retired", "mk2"): 4,
    }
