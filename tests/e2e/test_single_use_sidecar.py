"""Single-use unseals in the sealing sidecar: ``mrtr-keys serve --replay-store URL`` processes behind real MCP
servers (a replay is -32602 through any sidecar of the fleet, audited as ``replayed``; a client left out keeps
today's behaviour), and the app over a store that goes away: 503 and readiness down, then served again
without a restart; with ``on_replay_store_error = "allow"`` served during the outage (docs/single-use.md)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from fastapi.testclient import TestClient
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from mrtr_keys.example.app import build_server
from mrtr_keys.factory import request_state_security
from mrtr_keys.service.app import create_app
from mrtr_keys.service.clients import add_client
from mrtr_keys.service.config import ServiceConfig
from tests.e2e.servers import first_round, retry_round, text_of
from tests.fixtures.audit import cli
from tests.support.proxy import CountingProxy

pytestmark = pytest.mark.e2e
DONE = "Provisioned 'orders' in eu-west-1."


def _mcp(url: str, secret: str) -> Any:
    return build_server(request_state_security(sidecar=url, secret=secret, audience="provisioner"))


def test_a_replay_through_any_sidecar_is_refused_and_audited(
    keystore_path: Path, redis_replay_url: str, sidecar_factory: Callable[..., Any]
) -> None:
    clients = keystore_path.parent / "clients.json"
    _, pay = add_client(clients, "pay", audiences=["provisioner"])
    _, other = add_client(clients, "other", audiences=["provisioner"])
    extra = ["--replay-store", redis_replay_url, "--single-use-client", "pay"]
    a, b = sidecar_factory(keystore_path, extra=extra), sidecar_factory(keystore_path, extra=extra)
    token = anyio.run(first_round, _mcp(a.url, pay)).request_state or ""
    assert text_of(anyio.run(retry_round, _mcp(b.url, pay), token)) == DONE
    for side in (a, b):
        with pytest.raises(MCPError) as info:
            anyio.run(retry_round, _mcp(side.url, pay), token)
        assert info.value.code == INVALID_PARAMS
    free = anyio.run(first_round, _mcp(a.url, other)).request_state or ""
    for side in (a, b):  # a client not named keeps today's behaviour
        assert text_of(anyio.run(retry_round, _mcp(side.url, other), free)) == DONE
    assert "mrtr_keys_single_use_total" in a.http().get("/metrics").text
    a.stop()
    b.stop()  # each sidecar flushes its audit queue on exit
    res = cli("audit", "query", "--op", "unseal", "--client", "pay", "--json", keystore=keystore_path)
    assert res.code == 0, res.err
    assert sorted((e["outcome"], e["reason"]) for e in res.json()) == [
        ("ok", None),
        ("rejected", "replayed"),
        ("rejected", "replayed"),
    ]


def _app(keystore: Path, url: str, **kw: Any) -> Any:
    return create_app(ServiceConfig(replay_store=url, **kw), keystore=str(keystore), audit=None)


def test_a_store_outage_is_503_and_not_ready_until_the_store_is_back(
    keystore_path: Path, store_proxy: tuple[str, CountingProxy]
) -> None:
    url, proxy = store_proxy
    _, secret = add_client(keystore_path.parent / "clients.json", "pay", audiences=["svc"])
    auth = {"authorization": f"Bearer {secret}"}
    deny, allow = _app(keystore_path, url), _app(keystore_path, url, on_replay_store_error="allow")
    with TestClient(deny, headers=auth) as d, TestClient(allow, headers=auth) as a:

        def seal() -> str:
            token: str = d.post("/v1/seal", json={"audience": "svc", "payload": "AAAA"}).json()["token"]
            return token

        def unseal(client: TestClient, token: str) -> Any:
            return client.post("/v1/unseal", json={"audience": "svc", "token": token})

        token, other = seal(), seal()
        assert unseal(d, seal()).status_code == 200
        proxy.stop()
        refused = unseal(d, token)
        assert (refused.status_code, refused.json()) == (503, {"error": "replay_store_unavailable"})
        ready = d.get("/readyz")
        doc = ready.json()
        assert ready.status_code == 503 and "replay" in doc["down"], doc  # `down` names every store that is down
        # an authenticated caller also gets the store's URL (no password) and since when it is down
        assert doc["replay"] == {"url": url, "down_since": doc["down"]["replay"]}, doc
        # `reason` names one: the replay store, unless a starved host left the audit writer late to acknowledge
        # too (the audit store's reason then takes precedence)
        assert "replay store" in doc["reason"] or "audit" in doc["down"], doc
        assert [unseal(a, other).json()["payload"] for _ in range(2)] == ["AAAA", "AAAA"]  # allowed, unrecorded
        proxy.start()
        assert unseal(d, token).status_code == 200  # no restart; the refused token was not consumed
        replay = unseal(d, token)
        assert (replay.status_code, replay.json()) == (400, {"error": "invalid_token"})
        assert d.get("/readyz").status_code == 200
        metrics = d.get("/metrics").text
        assert 'mrtr_keys_single_use_total{outcome="store_error_denied"} 1.0' in metrics
        assert 'mrtr_keys_single_use_total{outcome="replayed"} 1.0' in metrics


def test_a_store_back_but_slow_to_answer_is_ready(keystore_path: Path, store_proxy: tuple[str, CountingProxy]) -> None:
    """Back after an outage, served an unseal, then every round trip 0.24 s late (within the store's 1 s
    deadline, past the 0.2 s readiness waits for a ping): readiness follows the store's last answer, so it is
    200 at once. Before, it kept the outage's last ping answer until a ping came back within 0.2 s (503 on
    each of these calls; in CI, a starved host's first ping after a plain restart was enough)."""
    url, proxy = store_proxy
    _, secret = add_client(keystore_path.parent / "clients.json", "pay", audiences=["svc"])
    with TestClient(_app(keystore_path, url), headers={"authorization": f"Bearer {secret}"}) as d:
        tokens = [d.post("/v1/seal", json={"audience": "svc", "payload": "AAAA"}).json()["token"] for _ in range(2)]
        proxy.stop()
        assert d.post("/v1/unseal", json={"audience": "svc", "token": tokens[0]}).status_code == 503
        assert d.get("/readyz").status_code == 503
        proxy.start()
        assert d.post("/v1/unseal", json={"audience": "svc", "token": tokens[1]}).status_code == 200
        # each way: a ping takes 0.24 s on an open connection, and up to three round trips (0.72 s) where it
        # reconnects (Redis: the outage dropped the ping's pooled connection); each within the 1 s deadline
        proxy.faults.latency(0.12)
        assert [d.get("/readyz").status_code for _ in range(3)] == [200, 200, 200]


def test_sidecar_single_use_settings_are_checked() -> None:
    from mrtr_keys.errors import ConfigError

    for bad in (
        {"single_use_clients": ["pay"]},  # without a store
        {"replay_store": "redis://127.0.0.1:6379/0", "on_replay_store_error": "maybe"},
        {"replay_store": "redis://127.0.0.1:6379/0", "single_use_audiences": "payments"},
    ):
        with pytest.raises(ConfigError):
            ServiceConfig.from_json(bad)
    ok = ServiceConfig.from_json({"replay_store": "redis://127.0.0.1:6379/0", "single_use_clients": ["pay"]})
    assert ServiceConfig.from_json(ok.to_json()) == ok
