"""TypeScript MCP servers (`@modelcontextprotocol/server` 2.4) sealing `requestState` through a real
``mrtr-keys serve``, end to end (issue 24).

One sidecar, ring and set of TS server processes for the module: two servers (A, B) behind a per-request
round-robin proxy, so every retry lands on the other process; a ``billing`` server (another sidecar client
and audience, state bound to the ``x-user`` header); a ``short`` server (TTL 0.5 s); and the control, a
server on the SDK's own HMAC ``createRequestStateCodec``; and ``once``, whose client (``ts-once``) the
sidecar holds to single use (``--replay-store`` on the local Redis, ``--single-use-client ts-once``).
Rounds are driven by the TS client (`@modelcontextprotocol/client`) and by the Python SDK client.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from tests.fixtures.audit import cli
from tests.fixtures.common import run_cli
from tests.fixtures.replay import REDIS_DB, REDIS_HOST, REDIS_PORT
from tests.fixtures.sidecar import Sidecar, start_sidecar
from tests.typescript.stack import (
    FROZEN,
    QUESTION_NOTE,
    RoundRobinProxy,
    TsServer,
    ensure_built,
    py_first_round,
    py_retry,
    start_ts_servers,
    ts_client,
    ts_client_running,
)

pytestmark = pytest.mark.e2e
DONE = "Provisioned 'orders' in eu-west-1."
RING_TTL = "5"
"""The key ring's TTL (seconds), and the TS servers' envelope TTL: rotate next waits promote + TTL + 60 s to retire."""


@dataclass
class Stack:
    ring: Path
    sidecar: Sidecar
    secret: str
    a: TsServer
    b: TsServer
    proxy: RoundRobinProxy
    billing: TsServer
    short: TsServer
    hmac: TsServer
    once: TsServer


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    ensure_built()
    root = tmp_path_factory.mktemp("ts-e2e")
    ring = root / "ring" / "keyring.json"
    # ring TTL 5 s (the servers' envelopes too): the rotation test waits the real retire gate, promote + TTL + 60 s
    assert cli("init", "--ttl", RING_TTL, "--audience", "orders", "--audience", "billing", keystore=ring).code == 0
    secret = _add_client(ring, "ts-orders", "orders")
    billing_secret = _add_client(ring, "ts-billing", "billing")
    once_secret = _add_client(ring, "ts-once", "orders")
    prefix = f"mrtr-test-{uuid.uuid4().hex[:12]}:"
    replay = f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}?prefix={prefix}"
    extra = ("--instance", "ts-e2e-sidecar", "--heartbeat-interval", "0.5")
    extra += ("--replay-store", replay, "--single-use-client", "ts-once")
    sidecar = start_sidecar(ring, workdir=root / "sidecar", reload_interval=0.2, extra=extra)
    orders = {
        "MRTR_KEYS_SIDECAR_URL": sidecar.url,
        "MRTR_KEYS_SIDECAR_SECRET": secret,
        "MRTR_TS_AUDIENCE": "orders",
        "MRTR_TS_TTL": RING_TTL,
    }
    proxy: RoundRobinProxy | None = None
    billing = {
        **orders,
        "MRTR_TS_AUDIENCE": "billing",
        "MRTR_KEYS_SIDECAR_SECRET": billing_secret,
        "MRTR_TS_BIND": "x-user",
    }
    servers = {
        "A": orders,
        "B": orders,
        "billing": billing,
        "short": {**orders, "MRTR_TS_TTL": "0.5"},
        "hmac": {"MRTR_TS_CODEC": "hmac", "MRTR_TS_HMAC_KEY": "k" * 32},
        "once": {**orders, "MRTR_KEYS_SIDECAR_SECRET": once_secret},
    }
    started: list[TsServer] = []
    try:
        started = start_ts_servers(root / "servers", servers)
        a, b, billing_server, short, hmac, once = started
        proxy = RoundRobinProxy([a.port, b.port])
        yield Stack(ring, sidecar, secret, a, b, proxy, billing_server, short, hmac, once)
    finally:
        if proxy is not None:
            proxy.close()
        for server in started:
            server.stop()
        sidecar.stop()
        _drop_keys(prefix)


def _drop_keys(prefix: str) -> None:
    import redis

    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=REDIS_DB)
    for key in client.scan_iter(match=prefix + "*", count=1000):
        client.delete(key)
    client.close()


def _add_client(ring: Path, name: str, audience: str) -> str:
    """``mrtr-keys clients add NAME --audience AUDIENCE --json`` (docs/typescript.md); the secret."""
    res = cli("clients", "add", name, "--audience", audience, "--json", keystore=ring)
    assert res.code == 0, res.err
    return str(res.json()["secret"])


def _refused(url: str, state: str, headers: dict[str, str] | None = None) -> MCPError:
    with pytest.raises(MCPError) as info:
        anyio.run(py_retry, url, state, headers)
    return info.value


def _assert_frozen(error: MCPError) -> None:
    """-32602 with the SDK's frozen message and nothing else: no reason, payload or token on the wire."""
    assert error.code == INVALID_PARAMS
    assert error.error.message == FROZEN
    assert error.error.data == {"reason": "invalid_request_state"}


def test_rounds_complete_with_the_ts_client_each_retry_on_the_other_process(stack: Stack) -> None:
    first = len(stack.proxy.hops)
    summary = ts_client(stack.proxy.url, "--rounds", "12")
    assert (summary["rounds"], summary["ok"], summary["rejected"], summary["failed"]) == (12, 12, 0, 0), summary
    assert set(summary["texts"]) <= {f"{DONE} (served by A)", f"{DONE} (served by B)"}, summary["texts"]
    calls = [h for h in stack.proxy.hops[first:] if h.method == "tools/call"]
    assert len(calls) == 24
    for leg, retry in zip(calls[::2], calls[1::2], strict=True):  # one client, one round at a time
        assert not leg.echoed_state and retry.echoed_state
        assert leg.backend != retry.backend


def test_rounds_complete_with_the_python_sdk_client(stack: Stack) -> None:
    served = set()
    for _ in range(2):
        state = anyio.run(py_first_round, stack.proxy.url)
        result = anyio.run(py_retry, stack.proxy.url, state)
        text = result.content[0].text  # type: ignore[union-attr]
        assert text.startswith(DONE)
        served.add(text)
        first = anyio.run(py_first_round, stack.a.url)  # and explicitly: minted by A, opened by B
        assert anyio.run(py_retry, stack.b.url, first).content[0].text == f"{DONE} (served by B)"  # type: ignore[union-attr]
    assert served == {f"{DONE} (served by A)", f"{DONE} (served by B)"}


def test_every_refusal_is_minus_32602_with_its_reason_only_in_onerror(stack: Stack) -> None:
    counts: dict[str, int] = {}
    state = anyio.run(py_first_round, stack.proxy.url)

    # tampered: one character of the token changed
    i = len(state) // 2
    tampered = state[:i] + ("A" if state[i] != "A" else "B") + state[i + 1 :]
    _assert_frozen(_refused(stack.a.url, tampered))
    stack.a.wait_reason("rejected")
    counts["tampered"] = 1

    # another audience: minted by the billing server (client ts-billing), echoed to an orders server
    alice = {"x-user": "alice"}
    foreign = anyio.run(py_first_round, stack.billing.url, alice)
    _assert_frozen(_refused(stack.b.url, foreign))
    stack.b.wait_reason("rejected")
    counts["other audience"] = 1

    # bind mismatch: minted for x-user alice, echoed by bob (alice herself still gets through)
    _assert_frozen(_refused(stack.billing.url, foreign, {"x-user": "bob"}))
    stack.billing.wait_reason("bind")
    assert anyio.run(py_retry, stack.billing.url, foreign, alice).content[0].text.startswith(DONE)  # type: ignore[union-attr]
    counts["bind mismatch"] = 1

    # expired: the short server's TTL is 0.5 s
    stale = anyio.run(py_first_round, stack.short.url)
    time.sleep(0.6)
    _assert_frozen(_refused(stack.short.url, stale))
    stack.short.wait_reason("expired")
    counts["expired"] = 1

    # a token of the SDK's own createRequestStateCodec (the HMAC control server)
    hmac_state = anyio.run(py_first_round, stack.hmac.url)
    assert hmac_state.startswith("v1.")
    _assert_frozen(_refused(stack.a.url, hmac_state))
    stack.a.wait_reason("rejected", count=2)
    counts["SDK HMAC token"] = 1

    # the reasons are in onerror only, never the payload or the secret
    for server in (stack.a, stack.b, stack.billing, stack.short):
        assert QUESTION_NOTE not in server.output() and stack.secret not in server.output()
    print(f"\nrefusals by case: {json.dumps(counts)}")


def _decodings(token: str) -> list[str]:
    """The token and every dot-separated part of it decoded as base64url, as text."""
    out = [token]
    for part in token.split("."):
        try:
            out.append(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)).decode("utf-8", "replace"))
        except (binascii.Error, ValueError):
            pass
    return out


def test_the_payload_is_confidential_while_the_sdk_hmac_codecs_is_readable(stack: Stack) -> None:
    ours = anyio.run(py_first_round, stack.proxy.url)
    control = anyio.run(py_first_round, stack.hmac.url)
    assert not any(QUESTION_NOTE in text for text in _decodings(ours))
    assert any(f"{QUESTION_NOTE} orders" in text for text in _decodings(control))  # signed, not encrypted


def test_the_audit_log_shows_the_ts_servers_seals_and_unseals(stack: Stack) -> None:
    state = anyio.run(py_first_round, stack.proxy.url)
    anyio.run(py_retry, stack.proxy.url, state)
    _assert_frozen(_refused(stack.proxy.url, state[:-2]))  # and one refused
    deadline = time.monotonic() + 20
    while True:  # the sidecar's audit writer appends in batches
        res = cli("audit", "query", "--client", "ts-orders", "--json", keystore=stack.ring)
        assert res.code == 0, res.err
        events = res.json()
        seen = {(e["op"], e["outcome"]) for e in events}
        if {("seal", "ok"), ("unseal", "ok"), ("unseal", "rejected")} <= seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {("seal", "ok"), ("unseal", "ok"), ("unseal", "rejected")} <= seen, events[-5:]
    assert {e["client"] for e in events} == {"ts-orders"} and {e["audience"] for e in events} == {"orders"}
    assert all(QUESTION_NOTE not in json.dumps(e) for e in events)


def test_single_use_refuses_a_replayed_retry_of_the_client_held_to_it(stack: Stack) -> None:
    state = anyio.run(py_first_round, stack.once.url)
    assert anyio.run(py_retry, stack.once.url, state).content[0].text == f"{DONE} (served by once)"  # type: ignore[union-attr]
    _assert_frozen(_refused(stack.once.url, state))
    stack.once.wait_reason("rejected")
    free = anyio.run(py_first_round, stack.proxy.url)  # a client not named keeps today's behaviour
    for _ in range(2):
        assert anyio.run(py_retry, stack.proxy.url, free).content[0].text.startswith(DONE)  # type: ignore[union-attr]
    deadline = time.monotonic() + 20
    while True:  # the sidecar's audit writer appends in batches
        res = cli("audit", "query", "--op", "unseal", "--client", "ts-once", "--json", keystore=stack.ring)
        assert res.code == 0, res.err
        seen = sorted((e["outcome"], e["reason"]) for e in res.json())
        if len(seen) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert seen == [("ok", None), ("rejected", "replayed")]


def test_two_rotations_under_continuous_rounds_reject_nothing(stack: Stack, tmp_path: Path) -> None:
    http = httpx.Client(base_url=stack.sidecar.url, headers={"authorization": f"Bearer {stack.secret}"}, timeout=10)
    kids_before = {k["kid"] for k in http.get("/v1/keys").json()["keys"]}
    stop = threading.Event()
    py = {"rounds": 0, "ok": 0, "rejected": 0, "failed": 0}
    errors: list[str] = []

    def python_rounds() -> None:
        while not stop.is_set():
            py["rounds"] += 1
            try:
                state = anyio.run(py_first_round, stack.proxy.url)
                assert anyio.run(py_retry, stack.proxy.url, state).content[0].text.startswith(DONE)  # type: ignore[union-attr]
                py["ok"] += 1
            except MCPError as exc:
                py["rejected" if exc.code == INVALID_PARAMS else "failed"] += 1
                errors.append(repr(exc))
            except Exception as exc:
                py["failed"] += 1
                errors.append(repr(exc))
            stop.wait(0.5)  # paced: rounds all through the rotation (each builds an MCP session), without a busy core

    steps: list[dict[str, Any]] = []
    thread = threading.Thread(target=python_rounds)
    with ts_client_running(stack.proxy.url, tmp_path / "stop", "--pace", "250") as ts:
        thread.start()
        try:
            time.sleep(0.5)
            for _ in range(2):
                for _phase in ("begin", "promote", "retire"):
                    started = time.monotonic()
                    # every gate waited for, none forced: retire comes promote + TTL 5 s + 60 s later
                    res = run_cli("rotate", "next", "--wait", "200", "--json", keystore=stack.ring, timeout=260)
                    assert res.code == 0, res.err
                    steps.append({**res.json(), "seconds": round(time.monotonic() - started, 1)})
                    stack.sidecar.wait_generation(stack.secret, res.json()["generation"])
        finally:
            stop.set()
            thread.join(timeout=30)
    kids_after = {k["kid"] for k in http.get("/v1/keys").json()["keys"] if k["state"] != "retired"}
    http.close()
    waits = [(s["step"], s["seconds"]) for s in steps]
    print(f"\nrotation: TS client {ts}, Python client {py}, steps {waits}")
    assert (ts["rejected"], ts["failed"], py["rejected"], py["failed"]) == (0, 0, 0, 0), (ts["errors"], errors)
    assert [s["step"] for s in steps] == ["begin", "promote", "retire"] * 2
    assert all(s.get("reason") is None and not s.get("forced") for s in steps), steps  # nothing forced
    assert all(w >= 60 for step, w in waits if step == "retire"), waits  # the TTL gate was waited for
    assert ts["rounds"] > 20 and py["rounds"] > 5
    assert not kids_before & kids_after  # two keys later, the first is retired
