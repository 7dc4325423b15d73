"""Call the example server's `provision` tool with the MCP SDK `Client`, answering its question.

    python -m mrtr_keys.example.client http://127.0.0.1:8000/mcp --name orders --region eu-west-1

prints the tool's final text (exit 0), or one error line (exit 1). The SDK's `Client` runs the
multi-round-trip loop: it dispatches the `InputRequiredResult`'s elicitation to
`elicitation_callback` and retries with the answer and the echoed `requestState`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import anyio
from mcp import Client
from mcp.client import ClientRequestContext
from mcp.client.session import ElicitationFnT
from mcp.shared.exceptions import MCPError
from mcp.types import ElicitRequestParams, ElicitResult, TextContent

from mrtr_keys.example.app import QUESTION_KEY, TOOL_NAME


def answer_with(region: str) -> ElicitationFnT:
    """An `elicitation_callback` that accepts with ``{"region": region}``."""

    async def handle_elicitation(context: ClientRequestContext, params: ElicitRequestParams) -> ElicitResult:
        return ElicitResult(action="accept", content={QUESTION_KEY: region})

    return handle_elicitation


async def provision(url: str, name: str, region: str) -> str:
    """Run ``provision(name)`` against the server at `url`, answering `region`; returns the result text.

    Raises:
        MCPError: the server refused a round (e.g. -32602 "Invalid or expired requestState").
        RuntimeError: the tool reported an error result.
    """
    refusal: MCPError | None = None
    async with Client(url, elicitation_callback=answer_with(region)) as client:
        try:
            result = await client.call_tool(TOOL_NAME, {"name": name})
        except MCPError as exc:  # re-raised below, so it does not leave the client wrapped in an ExceptionGroup
            refusal = exc
    if refusal is not None:
        raise refusal
    text = "".join(c.text for c in result.content if isinstance(c, TextContent))
    if result.is_error:
        raise RuntimeError(text)
    return text


def _first_leaf(exc: BaseException) -> BaseException:
    """The first non-group exception inside (anyio task groups wrap transport errors in groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m mrtr_keys.example.client``; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m mrtr_keys.example.client", description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the server's streamable HTTP URL, e.g. http://127.0.0.1:8000/mcp")
    parser.add_argument("--name", default="orders", help="the database name (tool argument)")
    parser.add_argument("--region", default="eu-west-1", help="the answer given to the server's question")
    args = parser.parse_args(argv)
    try:
        text = anyio.run(provision, args.url, args.name, args.region)
    except MCPError as exc:
        print(f"error: the server refused the call: {exc.code} {exc.message}", file=sys.stderr)
        return 1
    except Exception as exc:  # the command's one catch-all: a line, never a traceback
        leaf = _first_leaf(exc)
        print(f"error: calling {args.url} failed: {type(leaf).__name__}: {leaf}", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
