"""The SDK's rejection log line, which `mrtr_keys.audit.capture.sdk_capture` reads, pinned.

The capture depends on a private detail of the MCP SDK: ``_reject`` in mcp/server/request_state.py logs
``"requestState rejected on %s: %s"`` (method, reason) at WARNING on ``mcp.server.request_state``. mcp is
bounded to the tested minor release in pyproject.toml; this test drives a real `MCPServer` into a
rejection the SDK itself makes (a token replayed on another tool: "request binding") and checks both the
record's shape and that the capture turned it into the audit event.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError

from mrtr_keys.audit.capture.sdk_capture import SDK_LOGGER, SDK_MESSAGE, RejectionCapture
from mrtr_keys.example.app import build_server
from mrtr_keys.factory import request_state_security
from tests.e2e.servers import first_round
from tests.fixtures.audit import cli


async def _replay_on_other_tool(mcp: MCPServer, state: str) -> MCPError:
    async with Client(mcp) as client:
        try:
            await client.session.call_tool("other", {"name": "orders"}, request_state=state, allow_input_required=True)
        except MCPError as exc:
            return exc
    raise AssertionError("the replayed state was accepted")


def test_a_real_sdk_rejection_has_the_logged_shape_the_capture_reads(
    keystore_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mcp = build_server(request_state_security(keystore_path, audience="provisioner"))

    @mcp.tool(name="other")
    async def other(name: str) -> str:
        return name

    assert any(isinstance(h, RejectionCapture) for h in logging.getLogger(SDK_LOGGER).handlers)
    token = anyio.run(first_round, mcp).request_state or ""
    caplog.set_level(logging.WARNING, logger=SDK_LOGGER)
    refusal = anyio.run(_replay_on_other_tool, mcp, token)
    assert refusal.message == "Invalid or expired requestState"

    records = [r for r in caplog.records if r.name == SDK_LOGGER]
    assert [(r.levelno, r.msg, r.args) for r in records] == [
        (logging.WARNING, SDK_MESSAGE, ("tools/call", "request binding"))
    ]
    assert records[0].getMessage() == "requestState rejected on tools/call: request binding"

    from mrtr_keys.audit.capture.sink import live

    for sink in list(live):  # the writer is asynchronous: store what is queued before reading
        sink.flush()
    res = cli("audit", "query", "--json", "--outcome", "rejected", keystore=keystore_path)
    assert res.code == 0, res.err
    assert [(e["op"], e["reason"]) for e in res.json()] == [("unseal", "request binding")]
