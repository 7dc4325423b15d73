"""The example MCP server: one tool, `provision`, that asks a question through `InputRequiredResult`.

The flow is the MCP 2026-07-28 multi-round-trip request (the SDK's "multi-round-trip requests" page):

1. ``tools/call provision {"name": ...}`` without answers returns an `InputRequiredResult` with one
   elicitation (``input_requests["region"]``) and a ``request_state`` naming the question asked.
2. The client retries the same call with ``input_responses["region"]`` and the ``request_state``
   echoed unchanged; the tool answers with a normal `CallToolResult`.

The tool writes and reads plaintext state; the SDK's `RequestStateBoundary` seals it on the way out
and verifies it on the way in with whatever `RequestStateSecurity` the server was built with, so the
same server serves the local, KMS, Vault or sidecar codec, or the SDK's default ephemeral key.
"""

from __future__ import annotations

from mcp.server.mcpserver import Context, MCPServer, RequestStateSecurity
from mcp.types import ElicitRequest, ElicitRequestFormParams, ElicitResult, InputRequiredResult

DEFAULT_NAME = "provisioner"
"""The server name, and the audience used when none is given."""

TOOL_NAME = "provision"
QUESTION_KEY = "region"
"""The key of the one `input_requests` entry (and of its answer in `input_responses`)."""

QUESTION_STATE = "provision/region/v1"
"""The plaintext `request_state`: our own question identifier, checked on the retry.

The SDK binds the sealed state to the method, tool, arguments, audience and TTL, but it cannot know
which of our questions an answer belongs to; the MCP multi-round-trip page asks servers to put their own question
identifier in the state and check it (section "手工构造的状态")."""

ASK_REGION = ElicitRequest(
    params=ElicitRequestFormParams(
        message="Which region should the database live in?",
        requested_schema={
            "type": "object",
            "properties": {"region": {"type": "string"}},
            "required": ["region"],
        },
    )
)


def result_text(name: str, region: str, instance: str = "") -> str:
    """The text of the tool's final result (tests and docs compare against it)."""
    served = f" (served by {instance})" if instance else ""
    return f"Provisioned {name!r} in {region}.{served}"


def build_server(
    security: RequestStateSecurity | None,
    *,
    name: str = DEFAULT_NAME,
    instance: str = "",
) -> MCPServer:
    """An `MCPServer` named `name` with the `provision` tool.

    Args:
        security: the requestState policy, e.g. ``mrtr_keys.request_state_security(path, audience=name)``;
            None keeps the SDK's default (a key generated at process start, valid in this process only).
        name: the server name (the SDK's default audience claim).
        instance: a label added to the tool's final text ("served by ..."), so a test or a person can
            see which process of a fleet answered the retry; empty adds nothing.
    """
    mcp = MCPServer(name, request_state_security=security)

    @mcp.tool(name=TOOL_NAME)
    async def provision(name: str, ctx: Context) -> str | InputRequiredResult:
        """Provision a database. Asks which region to put it in."""
        answer = (ctx.input_responses or {}).get(QUESTION_KEY)
        if ctx.request_state != QUESTION_STATE or not isinstance(answer, ElicitResult):
            return InputRequiredResult(input_requests={QUESTION_KEY: ASK_REGION}, request_state=QUESTION_STATE)
        if answer.action != "accept":
            return f"Provisioning of {name!r} cancelled ({answer.action})."
        region = (answer.content or {}).get(QUESTION_KEY)
        if not isinstance(region, str) or not region:
            return InputRequiredResult(input_requests={QUESTION_KEY: ASK_REGION}, request_state=QUESTION_STATE)
        return result_text(name, region, instance)

    return mcp
