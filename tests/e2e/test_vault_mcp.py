"""MCP multi-round-trip flows with requestState sealed by Vault / OpenBao transit, both modes.

In memory (`Client(MCPServer)`) and as a fleet (round 1 on one server process, the retry on another);
the protocol rules are the MCP 2026-07-28 multi-round-trip page: every requestState that fails
verification is answered -32602 "Invalid or expired requestState", and a codec that raises while
sealing fails the round closed (-32603).
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult

import mrtr_keys
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.example.app import build_server
from mrtr_keys.example.client import answer_with
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import CodecSpec
from tests.e2e.fleet import INVALID_REQUEST_STATE, run_fleet_round_trip
from tests.e2e.servers import first_round, retry_round, text_of
from tests.fixtures.openbao import OpenBao
from tests.support.proxy import CountingProxy

PREFIX = {"remote": "mkv1.", "datakey": "mk2."}


def vault_ring(tmp_path: Path, key: str, mode: str) -> Path:
    path = tmp_path / f"{mode}-ring.json"
    create_ring(FileKeystore(path), codec=CodecSpec("vault-transit", {"key": key, "mode": mode}))
    return path


def server_for(path: Path) -> MCPServer:
    return build_server(mrtr_keys.request_state_security(path, audience="provisioner"))


@pytest.mark.parametrize("mode", ["remote", "datakey"])
def test_in_memory_multi_round_trip(bao_env: dict[str, str], transit_key: str, tmp_path: Path, mode: str) -> None:
    path = vault_ring(tmp_path, transit_key, mode)
    mcp = server_for(path)

    async def loop() -> CallToolResult:
        async with Client(mcp, elicitation_callback=answer_with("eu-west-1")) as client:
            return await client.call_tool("provision", {"name": "orders"})

    assert text_of(anyio.run(loop)) == "Provisioned 'orders' in eu-west-1."

    first = anyio.run(first_round, mcp)
    token = first.request_state or ""
    assert token.startswith(PREFIX[mode])
    # A second server instance built from the same ring (another process would do the same) accepts it.
    assert text_of(anyio.run(retry_round, server_for(path), token, "us-east-2")) == "Provisioned 'orders' in us-east-2."
    tampered = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    with pytest.raises(MCPError) as refused:
        anyio.run(retry_round, mcp, tampered)
    assert (refused.value.code, refused.value.message) == INVALID_REQUEST_STATE


def test_in_memory_flow_across_a_rotation(bao_env: dict[str, str], transit_key: str, tmp_path: Path) -> None:
    """A round sealed before `promote` (old transit version) is accepted after it by a reloaded server."""
    path = vault_ring(tmp_path, transit_key, "remote")
    run_step(FileKeystore(path), "begin")
    token = anyio.run(first_round, server_for(path)).request_state
    run_step(FileKeystore(path), "promote")
    final = anyio.run(retry_round, server_for(path), token, "ap-south-1")
    assert text_of(final) == "Provisioned 'orders' in ap-south-1."


def test_vault_down_fails_the_round_closed_and_the_server_recovers(
    bao_env: dict[str, str], bao_proxy: CountingProxy, transit_key: str, tmp_path: Path
) -> None:
    """Vault unreachable is BackendUnavailable inside the codec; the SDK turns a failing seal into
    -32603 and a failing unseal into its frozen -32602, and the same server works once Vault is back."""
    mcp = server_for(vault_ring(tmp_path, transit_key, "remote"))
    token = anyio.run(first_round, mcp).request_state
    bao_proxy.stop()

    async def first_round_refusal() -> MCPError | None:
        async with Client(mcp) as client:
            try:
                await client.session.call_tool("provision", {"name": "orders"}, allow_input_required=True)
            except MCPError as exc:
                return exc
        return None

    sealing = anyio.run(first_round_refusal)
    assert sealing is not None and (sealing.code, sealing.message) == (-32603, "Internal error")
    with pytest.raises(MCPError) as unsealing:
        anyio.run(retry_round, mcp, token)
    assert (unsealing.value.code, unsealing.value.message) == INVALID_REQUEST_STATE
    bao_proxy.start()
    assert anyio.run(first_round_refusal) is None
    assert text_of(anyio.run(retry_round, mcp, token)) == "Provisioned 'orders' in eu-west-1."


@pytest.mark.parametrize("mode", ["remote", "datakey"])
def test_fleet_round_trip_across_two_processes(
    bao_env: dict[str, str], openbao: OpenBao, transit_key: str, tmp_path: Path, mode: str
) -> None:
    """Round 1 on server process A, the retry on process B; both read BAO_ADDR/BAO_TOKEN."""
    path = vault_ring(tmp_path, transit_key, mode)
    result = run_fleet_round_trip(path, "provisioner", env=bao_env, log_dir=tmp_path)
    assert result.request_state.startswith(PREFIX[mode])
    assert result.accepted, result.explain()
    assert result.text == "Provisioned 'orders' in eu-west-1. (served by B)"
    if mode == "remote":
        assert openbao.requests_to(f"transit/decrypt/{transit_key}") >= 1
