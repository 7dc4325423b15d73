"""The pieces of the TypeScript end-to-end tests: the built package, TS server processes, a per-request
round-robin proxy, the TS client, and Python SDK rounds against any of them.

Nothing here picks a port and hopes: the TS servers and the proxy listen on port 0 and report the port
the kernel gave them; the sidecar comes from `tests.support.services` (retried on another port if taken).
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import select
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult, ElicitResult, InputRequiredResult

from tests.e2e.servers import answers, connect
from tests.support.net import stop_process

REPO = Path(__file__).resolve().parents[2]
TS_DIR = REPO / "clients" / "typescript"
NODE = shutil.which("node")
BUILD = TS_DIR / "build" / "test" / "e2e"
QUESTION_NOTE = "confidential note for"
"""Text inside every payload the test server mints (``confidential note for NAME``)."""
FROZEN = "Invalid or expired requestState"
"""The SDK's one message for every refused requestState (-32602)."""

_built = False


def ensure_built() -> None:
    """``npm ci`` (only when node_modules is missing) and ``npm run build:test``, once per process,
    under a file lock so parallel pytest workers do not build over each other."""
    global _built
    if _built:
        return
    assert NODE is not None, "node is not on PATH"
    npm = shutil.which("npm") or "npm"
    with open(TS_DIR / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (TS_DIR / "node_modules" / "@modelcontextprotocol" / "server").is_dir():
                _run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"])
            if not _fresh():
                _run([npm, "run", "--silent", "build:test"])
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _built = True


def _fresh() -> bool:
    """True if build/ is newer than every TypeScript source, tsconfig and the lockfile."""
    out = BUILD / "server.js"
    if not out.exists():
        return False
    sources = [p for d in ("src", "test", "bench", "examples") for p in (TS_DIR / d).rglob("*.ts")]
    sources += [TS_DIR / "package-lock.json", TS_DIR / "tsconfig.json", TS_DIR / "tsconfig.test.json"]
    built = out.stat().st_mtime
    return all(p.stat().st_mtime <= built for p in sources if p.exists())


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, cwd=TS_DIR, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@dataclass
class TsServer:
    """One ``node build/test/e2e/server.js`` process."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def reasons(self) -> list[str]:
        """The reasons `verify` gave for refused rounds, as the SDK reported them to ``onerror``."""
        marker = "requestState verification rejected tools/call: "
        return [line.split(marker, 1)[1].strip() for line in self.output().splitlines() if marker in line]

    def wait_reason(self, reason: str, count: int = 1, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.reasons().count(reason) < count:
            assert time.monotonic() < deadline, f"{self.name}: no {reason!r} in onerror: {self.output()[-2000:]}"
            time.sleep(0.02)

    def stop(self) -> None:
        stop_process(self.proc)


def start_ts_servers(workdir: Path, servers: Mapping[str, Mapping[str, str]], timeout: float = 30.0) -> list[TsServer]:
    """Start test servers (name -> settings, see clients/typescript/test/e2e/server.ts) side by side, each on
    a port of the kernel's choosing; returns them, in order, once every one listens (else stops them all)."""
    workdir.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MRTR_KEYS_", "MRTR_TS_"))}
    launched: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    for name, env in servers.items():
        log = workdir / f"ts-{name}.log"
        full = {**base, "MRTR_TS_PORT": "0", "MRTR_TS_INSTANCE": name, **env}
        with log.open("wb") as err:
            proc = subprocess.Popen(
                [NODE or "node", str(BUILD / "server.js")], stdout=subprocess.PIPE, stderr=err, env=full
            )
        launched.append((name, proc, log))
    try:
        return [TsServer(name, proc, _listening(name, proc, log, timeout), log) for name, proc, log in launched]
    except BaseException:
        for _, proc, _ in launched:
            stop_process(proc)
        raise


def start_ts_server(workdir: Path, name: str, env: Mapping[str, str], timeout: float = 30.0) -> TsServer:
    """`start_ts_servers` for one server."""
    return start_ts_servers(workdir, {name: env}, timeout)[0]


def _listening(name: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> int:
    """The port from the server's ``listening PORT`` line."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"TS server {name} not listening after {timeout} s: {log.read_text()}")
        chunk = os.read(proc.stdout.fileno(), 256)
        if not chunk:
            proc.wait(10)
            raise RuntimeError(f"TS server {name} exited with {proc.returncode}: {log.read_text()}")
        line += chunk
    word, port = line.decode().split()[:2]
    assert word == "listening", line
    return int(port)


_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "upgrade"})


@dataclass
class Hop:
    """One request the proxy forwarded: to which backend, the JSON-RPC method, whether it echoed a state."""

    backend: int
    method: str
    echoed_state: bool


@dataclass
class RoundRobinProxy:
    """An HTTP proxy on 127.0.0.1 (port 0) sending each *request* to the next backend in turn.

    Per request, not per connection: a client keeps one connection to the proxy, and still its retry
    goes to the other process. `hops` records every request forwarded.
    """

    backends: Sequence[int]
    hops: list[Hop] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _next: int = 0

    def __post_init__(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                index = proxy._pick(body)
                conn = http.client.HTTPConnection("127.0.0.1", proxy.backends[index], timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_DELETE = do_POST

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def _pick(self, body: bytes) -> int:
        try:
            doc = json.loads(body) if body else {}
        except ValueError:
            doc = {}
        params = doc.get("params") if isinstance(doc, dict) else None
        method = str(doc.get("method", "")) if isinstance(doc, dict) else ""
        echoed = isinstance(params, dict) and isinstance(params.get("requestState"), str)
        with self._lock:
            index = self._next % len(self.backends)
            self._next += 1
            self.hops.append(Hop(index, method, echoed))
        return index

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def ts_client(url: str, *args: str, timeout: float = 120.0) -> dict[str, Any]:
    """Run the TS client (clients/typescript/test/e2e/client.ts) to the end; its JSON summary."""
    proc = subprocess.run(
        [NODE or "node", str(BUILD / "client.js"), url, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return summary


@contextlib.contextmanager
def ts_client_running(url: str, stop_file: Path, *args: str) -> Iterator[dict[str, Any]]:
    """The TS client in a loop until the block ends; the yielded dict gets its summary afterwards."""
    proc = subprocess.Popen(
        [NODE or "node", str(BUILD / "client.js"), url, "--until", str(stop_file), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    summary: dict[str, Any] = {}
    try:
        yield summary
    finally:
        stop_file.touch()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        summary.update(json.loads(out.strip().splitlines()[-1]))


async def elicit(context: Any, params: Any) -> ElicitResult:
    return answers("eu-west-1")["region"]


def _client(url: str, headers: Mapping[str, str] | None) -> contextlib.AbstractAsyncContextManager[Client]:
    """A Python SDK client declaring form elicitation (the TS SDK checks the capability before it asks),
    over an HTTP client sharing the tests' one TLS context (`tests.e2e.servers.connect`)."""
    return connect(url, headers=headers, elicitation_callback=elicit)


async def py_first_round(url: str, headers: Mapping[str, str] | None = None) -> str:
    """Python SDK client: ``provision(orders)`` without answers; the `requestState` the server sent."""
    async with _client(url, headers) as client:
        result = await client.session.call_tool("provision", {"name": "orders"}, allow_input_required=True)
    assert isinstance(result, InputRequiredResult), result
    assert result.request_state
    return result.request_state


async def py_retry(url: str, state: str, headers: Mapping[str, str] | None = None) -> CallToolResult:
    """Python SDK client: the retry with the answer and `state` echoed.

    Raises:
        MCPError: the server refused the round.
    """
    refusal: MCPError | None = None
    async with _client(url, headers) as client:
        try:
            result = await client.session.call_tool(
                "provision",
                {"name": "orders"},
                input_responses=answers("eu-west-1"),
                request_state=state,
                allow_input_required=True,
            )
        except MCPError as exc:
            refusal = exc
    if refusal is not None:
        raise refusal
    assert isinstance(result, CallToolResult), result
    return result
