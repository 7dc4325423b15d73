"""A real `Client(MCPServer)` multi-round-trip call, requestState sealed by the local codec.

The protocol rules come from the MCP 2026-07-28 multi-round-trip page: the server returns
`InputRequiredResult`, the client retries with ``input_responses`` and the echoed ``requestState``, and every
requestState that fails verification is answered -32602 "Invalid or expired requestState".
"""

from __future__ import annotations

import anyio
import pytest
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult, ElicitRequest, InputRequiredResult

from mrtr_keys.codecs.aesgcm import MK2_PREFIX, TOKEN_PREFIX
from mrtr_keys.example.app import QUESTION_STATE
from mrtr_keys.example.client import answer_with
from tests.e2e.fleet import INVALID_REQUEST_STATE
from tests.e2e.servers import first_round, retry_round, text_of


def test_client_runs_the_elicitation_loop_and_gets_the_final_text(example_mcp: MCPServer) -> None:
    async def go() -> CallToolResult:
        async with Client(example_mcp, elicitation_callback=answer_with("eu-west-1")) as client:
            return await client.call_tool("provision", {"name": "orders"})

    result = anyio.run(go)
    assert not result.is_error
    assert text_of(result) == "Provisioned 'orders' in eu-west-1."


def test_by_hand_the_wire_state_is_our_sealed_token_and_the_retry_succeeds(example_mcp: MCPServer) -> None:
    first = anyio.run(first_round, example_mcp)
    assert isinstance(first, InputRequiredResult)
    question = (first.input_requests or {})["region"]
    assert isinstance(question, ElicitRequest)
    assert question.params.message == "Which region should the database live in?"
    token = first.request_state or ""
    assert token.startswith(MK2_PREFIX) and MK2_PREFIX == "mk2."
    assert QUESTION_STATE not in token  # sealed, not echoed in clear

    final = anyio.run(retry_round, example_mcp, token, "us-east-2")
    assert text_of(final) == "Provisioned 'orders' in us-east-2."


def _flip(token: str, index: int) -> str:
    ch = token[index]
    return token[:index] + ("B" if ch != "B" else "C") + token[index + 1 :]


@pytest.mark.parametrize("where", ["kid", "middle", "last"])
def test_a_tampered_request_state_is_refused_with_the_sdk_error(example_mcp: MCPServer, where: str) -> None:
    token = anyio.run(first_round, example_mcp).request_state or ""
    index = {"kid": len(TOKEN_PREFIX) + 1, "middle": len(token) // 2, "last": len(token) - 1}[where]
    with pytest.raises(MCPError) as refused:
        anyio.run(retry_round, example_mcp, _flip(token, index))
    assert (refused.value.code, refused.value.message) == INVALID_REQUEST_STATE


def test_a_token_replayed_for_other_arguments_is_refused(example_mcp: MCPServer) -> None:
    # The SDK binds the sealed envelope to the tool and a digest of its arguments.
    token = anyio.run(first_round, example_mcp, "orders").request_state
    with pytest.raises(MCPError) as refused:
        anyio.run(retry_round, example_mcp, token, "eu-west-1", "payments")
    assert (refused.value.code, refused.value.message) == INVALID_REQUEST_STATE


def test_a_token_from_another_ring_is_refused(example_mcp: MCPServer, tmp_path) -> None:
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.example.app import build_server
    from mrtr_keys.factory import request_state_security
    from mrtr_keys.keystores.file import FileKeystore

    other = tmp_path / "other.json"
    create_ring(FileKeystore(other))
    stranger = build_server(request_state_security(other, audience="provisioner"))
    token = anyio.run(first_round, stranger).request_state
    with pytest.raises(MCPError) as refused:
        anyio.run(retry_round, example_mcp, token)
    assert (refused.value.code, refused.value.message) == INVALID_REQUEST_STATE
