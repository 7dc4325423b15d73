"""MCP multi-round-trip calls sealed through the sealing sidecar (`SidecarCodec`).

The sidecar is a real `mrtr-keys serve` process; the MCP servers are the example server in memory, their
requestState sealed and unsealed over HTTP (or a Unix socket) by `mrtr_keys.request_state_security(sidecar=...)`.
Protocol rules: the MCP 2026-07-28 multi-round-trip page; every requestState that fails
verification is answered -32602 "Invalid or expired requestState".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.server.mcpserver import InvalidRequestState
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult

import mrtr_keys
from mrtr_keys.changes.create import create_ring
from mrtr_keys.codecs.sidecar_client import SidecarCodec
from mrtr_keys.errors import BackendUnavailable, ConfigError
from mrtr_keys.example.app import build_server
from mrtr_keys.example.client import answer_with
from mrtr_keys.keystores.file import FileKeystore
from tests.e2e.fleet import INVALID_REQUEST_STATE
from tests.e2e.servers import first_round, retry_round, text_of
from tests.fixtures.sidecar import Sidecar, start_sidecar
from tests.support.net import refused_port

AUD = "provisioner"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """One sidecar for the tests that leave it running."""
    root = tmp_path_factory.mktemp("sidecar-mcp")
    create_ring(FileKeystore(root / "keyring.json"))
    s = start_sidecar(root / "keyring.json", workdir=root)
    try:
        yield s
    finally:
        s.stop()


def test_multi_round_trip_through_the_sidecar(shared: Sidecar) -> None:
    sidecar = shared
    """The SDK's Client loop completes; the wire state is a sidecar-minted token."""
    secret = sidecar.add_client("flow", [AUD])
    security = mrtr_keys.request_state_security(sidecar=sidecar.url, secret=secret, audience=AUD)
    assert isinstance(security.codec, SidecarCodec)
    server = build_server(security, name=AUD)

    async def go() -> CallToolResult:
        async with Client(server, elicitation_callback=answer_with("eu-west-1")) as client:
            return await client.call_tool("provision", {"name": "orders"})

    assert text_of(anyio.run(go)) == "Provisioned 'orders' in eu-west-1."
    token = anyio.run(first_round, server).request_state or ""
    assert token.startswith("mk2.")
    with pytest.raises(MCPError) as refused:
        anyio.run(retry_round, server, token[:-1] + ("A" if token[-1] != "A" else "B"))
    assert (refused.value.code, refused.value.message) == INVALID_REQUEST_STATE


def test_two_servers_share_one_sidecar(shared: Sidecar) -> None:
    sidecar = shared
    """Round 1 on server A, the retry on server B: both seal through one sidecar, neither holds a key."""
    secret_a = sidecar.add_client("instance-a", [AUD])
    secret_b = sidecar.add_client("instance-b", [AUD])
    a = build_server(
        mrtr_keys.request_state_security(sidecar=sidecar.url, secret=secret_a, audience=AUD), name=AUD, instance="A"
    )
    b = build_server(
        mrtr_keys.request_state_security(sidecar=sidecar.url, secret=secret_b, audience=AUD), name=AUD, instance="B"
    )
    first = anyio.run(first_round, a)
    assert (
        text_of(anyio.run(retry_round, b, first.request_state, "us-east-2"))
        == "Provisioned 'orders' in us-east-2. (served by B)"
    )


def test_a_server_of_another_audience_refuses_the_token(shared: Sidecar) -> None:
    sidecar = shared
    """Audience binding end to end: a token minted for `provisioner` is refused by `billing` on the same sidecar."""
    secret = sidecar.add_client("both", [AUD, "billing"])
    a = build_server(mrtr_keys.request_state_security(sidecar=sidecar.url, secret=secret, audience=AUD), name=AUD)
    other = build_server(
        mrtr_keys.request_state_security(sidecar=sidecar.url, secret=secret, audience="billing"), name=AUD
    )
    first = anyio.run(first_round, a)
    with pytest.raises(MCPError) as refused:
        anyio.run(retry_round, other, first.request_state)
    assert (refused.value.code, refused.value.message) == INVALID_REQUEST_STATE


def test_over_a_unix_socket(keystore_path: Path, sidecar_factory: Any, tmp_path: Path) -> None:
    """`unix:///path` URLs: the same flow over the sidecar's Unix socket."""
    s: Sidecar = sidecar_factory(keystore_path, uds=tmp_path / "s.sock")
    secret = s.add_client("p", [AUD])
    server = build_server(mrtr_keys.request_state_security(sidecar=s.url, secret=secret, audience=AUD), name=AUD)
    first = anyio.run(first_round, server)
    assert (
        text_of(anyio.run(retry_round, server, first.request_state, "ap-south-1"))
        == "Provisioned 'orders' in ap-south-1."
    )


def test_unreachable_sidecar_is_backend_unavailable_and_the_sdk_fails_closed(sidecar: Sidecar) -> None:
    """Unreachable -> BackendUnavailable (not InvalidRequestState); the SDK call fails, never passes."""
    with refused_port() as port:
        codec = SidecarCodec(f"http://127.0.0.1:{port}", audience=AUD, secret="mks_x", timeout=1)
        with pytest.raises(BackendUnavailable):
            codec.seal(b"x")
        with pytest.raises(BackendUnavailable):
            codec.unseal("mk1.AAAA")
    secret = sidecar.add_client("p", [AUD])
    security = mrtr_keys.request_state_security(sidecar=sidecar.url, secret=secret, audience=AUD)
    server = build_server(security, name=AUD)
    token = anyio.run(first_round, server).request_state
    sidecar.stop()
    with pytest.raises(MCPError):
        anyio.run(retry_round, server, token)


def test_client_errors_are_distinct(shared: Sidecar) -> None:
    sidecar = shared
    """A wrong secret or an ungranted audience is a deployment error (ConfigError), a bad token is
    InvalidRequestState, and tokens visibly unusable never leave the process."""
    secret = sidecar.add_client("errors", [AUD])
    with pytest.raises(ConfigError, match="401"):
        SidecarCodec(sidecar.url, audience=AUD, secret="mks_wrong").seal(b"x")
    with pytest.raises(ConfigError, match="403"):
        SidecarCodec(sidecar.url, audience="billing", secret=secret).seal(b"x")
    codec = SidecarCodec(sidecar.url, audience=AUD, secret=secret)
    for bad in ("garbage", "mk1." + "A" * 70000, None, "\udcff"):
        with pytest.raises(InvalidRequestState):
            codec.unseal(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ttl"):
        mrtr_keys.request_state_security(sidecar=sidecar.url, secret=secret, audience=AUD, ttl=601)
    with pytest.raises(ConfigError):
        SidecarCodec("ftp://x", audience=AUD, secret=secret)
    assert secret not in repr(codec)


def test_request_state_security_fails_fast_on_a_secret_the_sidecar_refuses(sidecar: Any) -> None:
    """Our decision: a wrong secret is a deployment mistake to report at start, not on a user's first call."""
    with pytest.raises(ConfigError, match="401"):
        mrtr_keys.request_state_security(sidecar=sidecar.url, secret="mks_wrong", audience="provisioner")
