"""Single-use requestState in real MCP flows (in-memory `Client(MCPServer)`, local codec, audit log beside the
ring) on each store: a flow completes, a replay is -32602 on every instance and audited as ``replayed``, tools
left out keep today's behaviour, a store outage refuses rounds until the store is back (or serves them with
``on_store_error="allow"``), and of 4 processes x 50 threads unsealing one token exactly one wins."""

from __future__ import annotations

import multiprocessing
import threading
from pathlib import Path
from typing import Annotated, Any

import anyio
import pytest
from mcp.server.mcpserver import Elicit, InvalidRequestState, MCPServer, Resolve
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS
from pydantic import BaseModel

from mrtr_keys.example.app import build_server
from mrtr_keys.factory import request_state_security
from tests.e2e.servers import first_round, retry_round, text_of
from tests.fixtures.audit import cli
from tests.support.proxy import CountingProxy

pytestmark = pytest.mark.e2e
DONE = "Provisioned 'orders' in eu-west-1."


def _server(ring: Path, url: str, **kw: Any) -> MCPServer:
    return build_server(request_state_security(ring, audience="provisioner", single_use=url, **kw))


def _refused(mcp: MCPServer, token: str) -> MCPError:
    with pytest.raises(MCPError) as info:
        anyio.run(retry_round, mcp, token)
    assert info.value.code == INVALID_PARAMS and info.value.message == "Invalid or expired requestState"
    return info.value


def _reasons(ring: Path) -> list[tuple[str, str, str | None]]:
    from mrtr_keys.audit.capture.sink import live as _live

    for sink in list(_live):
        sink.flush()
    res = cli("audit", "query", "--op", "unseal", "--json", keystore=ring)
    assert res.code == 0, res.err
    return [(e["op"], e["outcome"], e["reason"]) for e in res.json()]


@pytest.fixture
def ring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.json"
    assert cli("init", "--audience", "provisioner", keystore=path).code == 0
    return path


def test_a_flow_completes_once_and_its_token_is_replayed_nowhere(ring: Path, replay_url: str) -> None:
    a, b = _server(ring, replay_url), _server(ring, replay_url, single_use_for={"provision"})
    token = anyio.run(first_round, a).request_state or ""
    assert text_of(anyio.run(retry_round, b, token)) == DONE  # the round may land on any instance
    _refused(a, token)  # the same token, the same arguments, on the other instance
    _refused(b, token)  # and on the one that served it
    assert _reasons(ring) == [
        ("unseal", "ok", None),
        ("unseal", "rejected", "replayed"),
        ("unseal", "rejected", "replayed"),
    ]


def test_a_tool_not_named_keeps_todays_behaviour(ring: Path, redis_replay_url: str) -> None:
    mcp = _server(ring, redis_replay_url, single_use_for={"approve_payment"})
    token = anyio.run(first_round, mcp).request_state or ""
    assert text_of(anyio.run(retry_round, mcp, token)) == DONE
    assert text_of(anyio.run(retry_round, mcp, token)) == DONE  # replayable until it expires, as without the option


def test_a_store_outage_refuses_rounds_until_the_store_is_back(
    ring: Path, store_proxy: tuple[str, CountingProxy]
) -> None:
    url, proxy = store_proxy
    deny, allow = _server(ring, url), _server(ring, url, on_store_error="allow")
    assert text_of(anyio.run(retry_round, deny, anyio.run(first_round, deny).request_state)) == DONE
    token = anyio.run(first_round, deny).request_state or ""
    other = anyio.run(first_round, allow).request_state or ""
    proxy.stop()
    _refused(deny, token)  # fail closed
    assert text_of(anyio.run(retry_round, allow, other)) == DONE  # opted out: served, unrecorded
    proxy.start()
    assert text_of(anyio.run(retry_round, deny, token)) == DONE  # no restart: the same server, the same token
    _refused(deny, token)
    assert ("unseal", "rejected", "replay store unavailable") in _reasons(ring)


# ---------------------------------------------------------------- race


def _racer(ring: str, url: str, token: str, start: Any, results: Any) -> None:
    """One process: 50 threads unseal `token` at once through their own guard; reports (ok, replayed, other)."""
    security = request_state_security(ring, audience="provisioner", audit=False, single_use=url)
    codec: Any = security.codec
    codec.guard.store.hmac_key()  # connect before the start line
    gate = threading.Barrier(50)
    counts = {"ok": 0, "replayed": 0, "other": 0}
    lock = threading.Lock()

    def one() -> None:
        gate.wait()
        try:
            codec.unseal(token)
            outcome = "ok"
        except InvalidRequestState as exc:
            outcome = "replayed" if str(exc) == "replayed" else "other"
        with lock:
            counts[outcome] += 1

    threads = [threading.Thread(target=one) for _ in range(50)]
    start.wait()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(counts)


def test_one_token_unsealed_by_4_processes_x_50_threads_succeeds_exactly_once(ring: Path, replay_url: str) -> None:
    token = request_state_security(ring, audience="provisioner", audit=False).codec.seal(b'{"v":1}')
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(str(ring), replay_url, token, start, results)) for _ in range(4)]
    for p in procs:
        p.start()
    counts = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    total = {k: sum(c[k] for c in counts) for k in ("ok", "replayed", "other")}
    print(f"race ({replay_url.split(':')[0]}): {total}")
    assert total == {"ok": 1, "replayed": 199, "other": 0}


# ---------------------------------------------------------------- resolver flows


class Approval(BaseModel):
    approve: bool


class Code(BaseModel):
    code: str


def ask_approval(amount: int) -> Elicit[Approval]:
    return Elicit(f"Approve a payment of {amount}?", Approval)


def ask_code(approval: Annotated[Approval, Resolve(ask_approval)]) -> Elicit[Code]:
    return Elicit("Second factor?", Code)


def _payments(ring: Path, url: str) -> MCPServer:
    """A tool whose two questions come from chained `Resolve(...)` resolvers: three rounds, two tokens."""
    mcp = MCPServer(
        "payments",
        request_state_security=request_state_security(
            ring, audience="payments", single_use=url, single_use_for={"approve_payment"}
        ),
    )

    @mcp.tool()
    def approve_payment(
        amount: int,
        approval: Annotated[Approval, Resolve(ask_approval)],
        code: Annotated[Code, Resolve(ask_code)],
    ) -> str:
        return f"paid {amount} ({approval.approve}, {code.code})"

    return mcp


def test_a_resolver_flow_driven_by_the_client_completes_with_single_use(ring: Path, redis_replay_url: str) -> None:
    from mcp import Client
    from mcp.types import ElicitResult

    assert cli("audience", "add", "payments", keystore=ring).code == 0
    mcp = _payments(ring, redis_replay_url)
    asked: list[str] = []

    async def answer(context: Any, params: Any) -> ElicitResult:
        asked.append(params.message)
        content = {"approve": True} if "Approve" in params.message else {"code": "123456"}
        return ElicitResult(action="accept", content=content)

    async def flow() -> str:
        async with Client(mcp, elicitation_callback=answer) as client:
            return text_of(await client.call_tool("approve_payment", {"amount": 5}))

    assert anyio.run(flow) == "paid 5 (True, 123456)"
    assert asked == ["Approve a payment of 5?", "Second factor?"]  # three rounds, each token unsealed once
    assert _reasons(ring) == [("unseal", "ok", None), ("unseal", "ok", None)]
