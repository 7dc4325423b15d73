"""Example MCP servers in subprocesses, and the two rounds of a `provision` call.

`ServerPool` launches ``python -m mrtr_keys.example`` processes on free 127.0.0.1 ports, each logging to
its own file, and stops every one of them on exit (also when a launch or a test fails):

    with ServerPool(tmp_path) as pool:
        a = pool.start(keystore=path, audience="provisioner", instance="A")
        text = anyio.run(call_provision, a.url, "eu-west-1")

`first_round` / `retry_round` drive the multi-round-trip by hand with
``client.session.call_tool(..., allow_input_required=True)``, so each round can go to a different
server (the protocol 2026-07-28 streamable HTTP transport is one self-contained POST a request, with no
session to pin a client to a process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.server.mcpserver import MCPServer
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult, ElicitResult, InputRequiredResult, TextContent

from mrtr_keys.example.app import QUESTION_KEY, TOOL_NAME
from tests.support import tls, zygote
from tests.support.net import IN_USE, free_port, stop_process

RING_KEY: tuple[str, ...] = ("--codec-from-ring",)
"""Key-source flags: the codec the key ring records (the default)."""
SDK_DEFAULT_KEY: tuple[str, ...] = ("--sdk-default-key",)
"""Key-source flags: the MCP SDK's per-process ephemeral key."""

Target = str | MCPServer
"""A server URL (streamable HTTP) or an in-process `MCPServer`."""


@asynccontextmanager
async def connect(
    target: Target, *, headers: Mapping[str, str] | None = None, elicitation_callback: Any = None
) -> AsyncIterator[Client]:
    """An open MCP `Client` to `target`: for a URL, streamable HTTP with the MCP SDK's own timeouts
    (`mcp.shared._httpx_utils.create_mcp_http_client`) over an HTTP client sharing the tests' one TLS
    context (`tests.support.tls`: `Client(url)` would build one per connection, two a round), sending
    `headers` on every request; `elicitation_callback` as `Client` takes it."""
    if not isinstance(target, str):
        async with Client(target, elicitation_callback=elicitation_callback) as client:
            yield client
        return
    timeout = httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT)
    async with httpx2.AsyncClient(timeout=timeout, verify=tls.CONTEXT, headers=dict(headers or {})) as http:
        transport = streamable_http_client(target, http_client=http)
        async with Client(transport, elicitation_callback=elicitation_callback) as client:
            yield client


@dataclass
class ExampleServer:
    """One ``python -m mrtr_keys.example`` process."""

    instance: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)
    ready: bool = False
    retries: int = 0
    env: dict[str, str] = field(default_factory=dict, repr=False)
    cwd: str | os.PathLike[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def output(self) -> str:
        """Everything the process printed so far (stdout and stderr)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class ServerPool:
    """Launches example servers and stops all of them on `close` (a context manager)."""

    def __init__(self, log_dir: Path, *, env: Mapping[str, str] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.env = dict(env or {})
        self.servers: list[ExampleServer] = []

    def launch(
        self,
        *,
        keystore: str | os.PathLike[str] | None,
        audience: str = "provisioner",
        instance: str = "",
        key_args: Sequence[str] = RING_KEY,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> ExampleServer:
        """Start a server process (without waiting for it to listen; see `wait_ready`)."""
        port = free_port()
        label = instance or f"server-{len(self.servers) + 1}"
        args = [sys.executable, "-m", "mrtr_keys.example", "--audience", audience, "--port", str(port)]
        args += ["--host", "127.0.0.1", "--instance", instance]
        if keystore is not None:
            args += ["--keystore", str(keystore)]
        args += [*key_args, *extra_args]
        return self.spawn(args, port=port, instance=label, env=env, cwd=cwd)

    def spawn(
        self,
        args: Sequence[str],
        *,
        port: int,
        instance: str,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> ExampleServer:
        """Start `args` (a server command line that listens on 127.0.0.1:`port`), logging to a file.

        If the port turns out to be taken (someone bound it after `free_port`), `wait_ready` starts the
        server again with every ``port`` argument replaced by a new free port: read `ExampleServer.port`
        after `wait_ready`.
        """
        full_env = {**os.environ, **self.env, **(env or {}), "PYTHONUNBUFFERED": "1"}
        proc, log_path = self._popen(list(args), instance, port, full_env, cwd)
        server = ExampleServer(instance, port, proc, log_path, list(args), env=full_env, cwd=cwd)
        self.servers.append(server)
        return server

    def _popen(
        self, args: list[str], instance: str, port: int, env: dict[str, str], cwd: str | os.PathLike[str] | None
    ) -> tuple[subprocess.Popen[bytes], Path]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{instance}-{port}.log"
        with log_path.open("wb") as log:
            proc = zygote.popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd) or subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd
            )
        return proc, log_path

    def _respawn(self, server: ExampleServer) -> bool:
        """Start `server` again on a new port if it exited because its port was taken; else False."""
        if server.retries >= 5 or IN_USE not in server.output().lower():
            return False
        old, new = str(server.port), str(free_port())
        server.args = [new if a == old else a.replace(f":{old}", f":{new}") for a in server.args]
        server.port = int(new)
        server.retries += 1
        server.proc, server.log_path = self._popen(server.args, server.instance, server.port, server.env, server.cwd)
        return True

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until every launched server accepts connections (uvicorn binds after app startup).

        Raises:
            RuntimeError: a server exited first (its output is in the message).
            TimeoutError: a server did not listen within `timeout` seconds.
        """
        import socket

        deadline = time.monotonic() + timeout
        pending = [s for s in self.servers if not s.ready]
        while pending:
            for server in list(pending):
                if server.proc.poll() is not None:
                    if self._respawn(server):
                        continue
                    raise RuntimeError(
                        f"example server {server.instance} exited with {server.proc.returncode}:\n{server.output()}"
                    )
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.settimeout(0.2)
                    if s.connect_ex(("127.0.0.1", server.port)) == 0:
                        server.ready = True
                        pending.remove(server)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"example servers not listening after {timeout} s: {[s.instance for s in pending]}")
            if pending:
                time.sleep(0.05)

    def start(self, **kwargs: Any) -> ExampleServer:
        """`launch` then `wait_ready`."""
        server = self.launch(**kwargs)
        self.wait_ready()
        return server

    def stop(self, server: ExampleServer) -> None:
        stop_process(server.proc)

    def close(self) -> None:
        """Stop every server this pool launched."""
        for server in self.servers:
            stop_process(server.proc)

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def answers(region: str) -> dict[str, ElicitResult]:
    """The ``input_responses`` that answer the example's question with `region`."""
    return {QUESTION_KEY: ElicitResult(action="accept", content={QUESTION_KEY: region})}


def text_of(result: CallToolResult) -> str:
    """The concatenated text content of a tool result."""
    return "".join(c.text for c in result.content if isinstance(c, TextContent))


async def first_round(target: Target, name: str = "orders") -> InputRequiredResult:
    """Call ``provision(name)`` without answers; returns the server's `InputRequiredResult`."""
    async with connect(target) as client:
        result = await client.session.call_tool(TOOL_NAME, {"name": name}, allow_input_required=True)
    assert isinstance(result, InputRequiredResult), f"expected InputRequiredResult, got {result!r}"
    return result


async def retry_round(
    target: Target, request_state: str | None, region: str = "eu-west-1", name: str = "orders"
) -> CallToolResult:
    """Retry ``provision(name)`` with the answer and the echoed `request_state`.

    Raises:
        MCPError: the server refused the round (e.g. -32602 "Invalid or expired requestState").
    """
    refusal: MCPError | None = None
    async with connect(target) as client:
        try:
            result = await client.session.call_tool(
                TOOL_NAME,
                {"name": name},
                input_responses=answers(region),
                request_state=request_state,
                allow_input_required=True,
            )
        except MCPError as exc:  # raised outside the `async with`, it would come out wrapped in an ExceptionGroup
            refusal = exc
    if refusal is not None:
        raise refusal
    assert isinstance(result, CallToolResult), f"expected CallToolResult, got {result!r}"
    return result
