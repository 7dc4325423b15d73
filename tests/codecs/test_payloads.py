"""The SDK's payload contract: any payload the SDK's own codec takes, up to what its HTTP
transport delivers, round-trips through our codecs and the sidecar.

Before, a payload over 49,117 bytes was refused (the sidecar: over 32,768), so a real `MCPServer` with a
60,000-character state answered -32603 where the SDK's own codec worked. The one token cap is now the
SDK's request body limit (`mrtr_keys.token.MAX_TOKEN_CHARS`); the payload cap and the sidecar's default
body limit derive from it.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.server.mcpserver import Context, MCPServer, RequestStateSecurity
from mcp.server.request_state import AESGCMRequestStateCodec
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE
from mcp.types import CallToolResult, ElicitRequest, ElicitRequestFormParams, ElicitResult, InputRequiredResult

import mrtr_keys
from mrtr_keys.codecs.aesgcm import MAX_PAYLOAD_BYTES
from mrtr_keys.service.config import DEFAULT_MAX_BODY_BYTES, ServiceConfig
from mrtr_keys.service.validation import MAX_PAYLOAD_B64_CHARS
from mrtr_keys.token import MAX_TOKEN_CHARS

STATE = "s" * 60_000
ASK = ElicitRequest(
    params=ElicitRequestFormParams(message="Go on?", requested_schema={"type": "object", "properties": {}})
)


def test_the_token_cap_is_the_sdk_http_body_limit() -> None:
    """One cap: the SDK's streamable HTTP transport refuses request bodies over 4 MiB; no token it can deliver
    is refused for its length, and the sidecar's default body holds a token at the cap plus JSON around it."""
    assert MAX_TOKEN_CHARS == DEFAULT_MAX_REQUEST_BODY_SIZE == 4 * 1024 * 1024
    assert DEFAULT_MAX_BODY_BYTES > MAX_TOKEN_CHARS and ServiceConfig().max_body_bytes == DEFAULT_MAX_BODY_BYTES
    assert MAX_PAYLOAD_B64_CHARS < MAX_TOKEN_CHARS < DEFAULT_MAX_BODY_BYTES


def _server(security: RequestStateSecurity | None) -> MCPServer:
    mcp = MCPServer("big-state", request_state_security=security)

    @mcp.tool(name="long")
    async def long(ctx: Context) -> str | InputRequiredResult:
        """Asks once, carrying a 60,000-character state; checks it comes back whole."""
        if ctx.request_state is None:
            return InputRequiredResult(input_requests={"go": ASK}, request_state=STATE)
        return "state intact" if ctx.request_state == STATE else "state changed"

    return mcp


async def _call(server: MCPServer) -> CallToolResult:
    async with Client(server) as client:
        first = await client.session.call_tool("long", {}, allow_input_required=True)
        assert isinstance(first, InputRequiredResult) and first.request_state
        answer = {"go": ElicitResult(action="accept", content={})}
        return await client.session.call_tool(
            "long", {}, input_responses=answer, request_state=first.request_state, allow_input_required=True
        )


def _text(result: CallToolResult) -> str:
    return "".join(getattr(c, "text", "") for c in result.content)


def test_a_60000_character_state_round_trips_like_the_sdk_codec(keystore_path: Path) -> None:
    """The SDK's own codec carries it (the reference); ours must too."""
    sdk = RequestStateSecurity(codec=AESGCMRequestStateCodec([b"k" * 32]))
    assert _text(anyio.run(_call, _server(sdk))) == "state intact"
    ours = mrtr_keys.request_state_security(keystore_path, audience="big-state")
    result = anyio.run(_call, _server(ours))
    assert not result.is_error and _text(result) == "state intact"


def test_a_60000_character_state_round_trips_through_the_sidecar(keystore_path: Path, sidecar_factory: Any) -> None:
    sidecar = sidecar_factory(keystore_path)
    secret = sidecar.add_client("big-state", ["big-state"])
    security = mrtr_keys.request_state_security(sidecar=sidecar.url, secret=secret, audience="big-state")
    result = anyio.run(_call, _server(security))
    assert not result.is_error and _text(result) == "state intact"


@pytest.mark.parametrize("size", [64 * 1024, 1024 * 1024, MAX_PAYLOAD_BYTES])
def test_payloads_up_to_the_cap_round_trip_through_the_sidecar(size: int, sidecar: Any) -> None:
    """The sidecar's default limits carry every payload the local codec seals, up to the cap's own payload."""
    secret = sidecar.add_client(f"p{size}", ["big"])
    http = sidecar.http(secret)
    payload = bytes(range(256)) * (size // 256) + b"\x01" * (size % 256)
    text = base64.urlsafe_b64encode(payload).decode().rstrip("=")
    sealed = http.post("/v1/seal", json={"audience": "big", "payload": text}, timeout=30)
    assert sealed.status_code == 200, sealed.text[:200]
    token = sealed.json()["token"]
    assert len(token) <= MAX_TOKEN_CHARS
    opened = http.post("/v1/unseal", json={"audience": "big", "token": token}, timeout=30)
    assert opened.status_code == 200 and opened.json()["payload"] == text
