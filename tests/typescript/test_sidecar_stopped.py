"""A TypeScript server whose sidecar stops (issue 24), with a sidecar of its own: every round fails closed
(-32602 on a retry, a tool error with the reason code alone on a first round, nothing leaked)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult, TextContent
from mcp_types import INVALID_PARAMS

from tests.fixtures.audit import cli
from tests.fixtures.sidecar import start_sidecar
from tests.typescript.stack import (
    FROZEN,
    QUESTION_NOTE,
    elicit,
    ensure_built,
    py_first_round,
    py_retry,
    start_ts_server,
)

pytestmark = pytest.mark.e2e
DONE = "Provisioned 'orders' in eu-west-1."


def _ring_with_client(tmp_path: Path, client: str) -> tuple[Path, str]:
    ring = tmp_path / "ring" / "keyring.json"
    assert cli("init", "--audience", "orders", keystore=ring).code == 0
    res = cli("clients", "add", client, "--audience", "orders", "--json", keystore=ring)
    assert res.code == 0, res.err
    return ring, str(res.json()["secret"])


async def _call(url: str) -> object:
    async with Client(url, elicitation_callback=elicit) as client:
        return await client.session.call_tool("provision", {"name": "orders"}, allow_input_required=True)


def test_a_stopped_sidecar_fails_rounds_closed(tmp_path: Path) -> None:
    ensure_built()
    ring, secret = _ring_with_client(tmp_path, "ts-orders")
    sidecar = start_sidecar(ring, workdir=tmp_path / "sidecar")
    env = {"MRTR_KEYS_SIDECAR_URL": sidecar.url, "MRTR_KEYS_SIDECAR_SECRET": secret}
    server = start_ts_server(tmp_path / "servers", "A", env)
    try:
        state = anyio.run(py_first_round, server.url)
        sidecar.stop()
        with pytest.raises(MCPError) as info:
            anyio.run(py_retry, server.url, state)
        assert (info.value.code, info.value.error.message) == (INVALID_PARAMS, FROZEN)
        server.wait_reason("sidecar_unavailable")
        # a first round cannot mint: the tool fails with the reason code alone and no requestState
        failed = anyio.run(_call, server.url)
        assert isinstance(failed, CallToolResult) and failed.is_error
        assert [c.text for c in failed.content if isinstance(c, TextContent)] == ["sidecar_unavailable"]
        assert secret not in server.output() and QUESTION_NOTE not in server.output()
    finally:
        server.stop()
        sidecar.stop()
