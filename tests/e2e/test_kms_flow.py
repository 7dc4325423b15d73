"""The MCP multi-round-trip flow with requestState sealed by the KMS envelope codec.

Against moto in server mode behind a counting proxy: the data keys are unwrapped once when the
codec is built, and the rounds themselves make no KMS request.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp.types import CallToolResult

from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs.kms import KMSEnvelopeCodec
from mrtr_keys.example.app import DEFAULT_NAME, build_server
from mrtr_keys.example.client import answer_with
from mrtr_keys.factory import request_state_security
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import CodecSpec
from tests.e2e.fleet import INVALID_REQUEST_STATE, run_fleet_round_trip
from tests.e2e.servers import first_round, retry_round, text_of
from tests.fixtures.moto_kms import KMSEnv


def kms_ring(tmp_path: Path, kms: KMSEnv) -> Path:
    path = tmp_path / "keyring.json"
    create_ring(FileKeystore(path), codec=CodecSpec("kms", {"kms_key_id": kms.create_key()}))
    return path


def test_client_flow_with_the_kms_codec_makes_no_kms_call_per_round(kms: KMSEnv, tmp_path: Path) -> None:
    path = kms_ring(tmp_path, kms)
    kms.proxy.reset()
    security = request_state_security(path, audience=DEFAULT_NAME)
    assert isinstance(security.codec, KMSEnvelopeCodec)
    assert kms.proxy.calls == {"Decrypt": 1}
    mcp = build_server(security)

    async def go() -> CallToolResult:
        async with Client(mcp, elicitation_callback=answer_with("eu-west-1")) as client:
            return await client.call_tool("provision", {"name": "orders"})

    for _ in range(5):
        assert text_of(anyio.run(go)) == "Provisioned 'orders' in eu-west-1."
    assert kms.proxy.calls == {"Decrypt": 1}


def test_by_hand_the_token_is_ours_and_a_tampered_one_is_refused(kms: KMSEnv, tmp_path: Path) -> None:
    path = kms_ring(tmp_path, kms)
    mcp = build_server(request_state_security(path, audience=DEFAULT_NAME))
    token = anyio.run(first_round, mcp).request_state or ""
    assert token.startswith("mk2.")
    assert text_of(anyio.run(retry_round, mcp, token, "us-east-2")) == "Provisioned 'orders' in us-east-2."
    tampered = token[:-2] + ("A" if token[-2] != "A" else "B") + token[-1]
    with pytest.raises(MCPError) as refused:
        anyio.run(retry_round, mcp, tampered)
    assert (refused.value.code, refused.value.message) == INVALID_REQUEST_STATE


def test_fleet_two_processes_one_kms_ring(kms: KMSEnv, tmp_path: Path) -> None:
    # The fleet test as for the local codec; each process unwraps the ring's keys once.
    path = kms_ring(tmp_path, kms)
    run_step(FileKeystore(path), "begin")  # two usable data keys
    kms.proxy.reset()
    result = run_fleet_round_trip(path, "provisioner", env=kms.env, log_dir=tmp_path)
    assert result.request_state.startswith("mk2.")
    assert result.accepted, result.explain()
    assert result.text == "Provisioned 'orders' in eu-west-1. (served by B)"
    # 2 usable data keys unwrapped once per process start, none per round (4 unless a server found its port
    # taken and was started again on another: the first one had unwrapped its keys too)
    assert kms.proxy.calls == {"Decrypt": 2 * result.starts}, result.starts
