"""The audit log after a real MCP flow (in-memory `Client(MCPServer)`, local codec, default store beside
the ring): every event kind with its fields, the SDK's own rejection reasons, and nothing secret stored."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError

from mrtr_keys.audit.events import FIELDS
from mrtr_keys.audit.writing.fingerprint import Fingerprinter, load_audit_key
from mrtr_keys.example.app import QUESTION_STATE, build_server
from mrtr_keys.factory import request_state_security
from mrtr_keys.ring.document import ring_from_json
from tests.e2e.servers import first_round, retry_round, text_of
from tests.fixtures.audit import cli


def _server(ring: Path, *, ttl: float = 600.0) -> MCPServer:
    mcp = build_server(request_state_security(ring, audience="provisioner", ttl=ttl))

    @mcp.tool(name="other")
    async def other(name: str) -> str:
        return f"other {name}"

    return mcp


async def _call_other_with(mcp: MCPServer, state: str) -> None:
    refusal: MCPError | None = None
    async with Client(mcp) as client:
        try:
            await client.session.call_tool("other", {"name": "orders"}, request_state=state, allow_input_required=True)
        except MCPError as exc:
            refusal = exc
    assert refusal is not None and refusal.message == "Invalid or expired requestState"


def _events(ring: Path, *args: str) -> list[dict[str, Any]]:
    res = cli("audit", "query", "--json", *args, keystore=ring)
    assert res.code == 0, res.err
    return list(res.json())


def _flush_all() -> None:
    from mrtr_keys.audit.capture.sink import live as _live

    for sink in list(_live):
        sink.flush()


def test_every_event_kind_and_sdk_reasons_after_a_real_mcp_flow(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", "--audience", "provisioner", keystore=ring).code == 0
    assert cli("rotate", "begin", keystore=ring).code == 0
    mcp = _server(ring)
    first = anyio.run(first_round, mcp)
    token = first.request_state or ""
    assert text_of(anyio.run(retry_round, mcp, token, "eu-west-1")) == "Provisioned 'orders' in eu-west-1."
    for bad in (
        lambda: anyio.run(retry_round, mcp, token, "eu-west-1", "someone-else"),  # wrong arguments
        lambda: anyio.run(_call_other_with, mcp, token),  # wrong tool
        lambda: anyio.run(retry_round, mcp, token[:-3] + "AAA"),  # tampered: our codec's reason
        lambda: anyio.run(
            retry_round, _server(ring, ttl=1e-6), anyio.run(first_round, _server(ring, ttl=1e-6)).request_state
        ),
    ):
        try:
            bad()
        except (MCPError, AssertionError):
            pass
    assert cli("audience", "add", "billing", keystore=ring).code == 0
    _flush_all()

    events = _events(ring)
    assert all(list(e) == list(FIELDS) for e in events)
    ops = {e["op"] for e in events}
    assert {"init", "begin", "audience", "ring-loaded", "seal", "unseal"} <= ops
    fp = Fingerprinter(load_audit_key(tmp_path)).fingerprint(token)
    life = [e for e in events if e["fingerprint"] == fp]
    assert [(e["op"], e["outcome"], e["reason"]) for e in life] == [
        ("seal", "ok", None),
        ("unseal", "ok", None),
        ("unseal", "rejected", "request binding"),  # wrong arguments: the SDK's reason, one event
        ("unseal", "rejected", "request binding"),  # wrong tool
    ]
    kid = life[0]["kid"]
    assert all(e["kid"] == kid and e["audience"] == "provisioner" and e["generation"] == 2 for e in life)
    assert all(e["instance"] == life[0]["instance"] for e in life)
    rejected = _events(ring, "--outcome", "rejected")
    assert {e["reason"] for e in rejected} == {"request binding", "seal", "expired"}
    loaded = _events(ring, "--op", "ring-loaded")
    # every server loaded generation 2 (the primary `kid`); one still running may also have loaded 3 (the
    # `audience add` above) before the query, on a slow machine
    at_2 = [e for e in loaded if e["generation"] == 2]
    assert at_2 and all(e["kid"] == kid for e in at_2)
    assert {e["generation"] for e in loaded} <= {2, 3}
    [aud] = _events(ring, "--op", "audience")
    assert (aud["audience"], aud["reason"], aud["generation"]) == ("billing", "added", 3)
    [init] = _events(ring, "--op", "init")
    assert init["generation"] == 1 and init["kid"] == kid

    # Never stored: tokens, payloads, plaintext, key material.
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("audit.db*"))
    ring_doc = json.loads(ring.read_text())
    secrets = [token.encode(), token[4:].encode(), QUESTION_STATE.encode(), base64.urlsafe_b64decode(token[4:] + "==")]
    for key in ring_from_json(ring_doc).keys:
        assert key.material is not None
        secrets += [key.material, base64.b64encode(key.material), base64.urlsafe_b64encode(key.material).rstrip(b"=")]
    secrets.append((tmp_path / "audit.key").read_bytes())
    for s in secrets:
        assert s not in stored


@pytest.mark.parametrize("store", ["jsonl", "postgres"])
def test_other_stores_hold_no_token_payload_or_key(tmp_path: Path, store: str, request: pytest.FixtureRequest) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    url = f"jsonl://{tmp_path}/audit.jsonl" if store == "jsonl" else request.getfixturevalue("postgres_url")
    mcp = build_server(request_state_security(ring, audience="provisioner", audit=url))
    token = anyio.run(first_round, mcp).request_state or ""
    anyio.run(retry_round, mcp, token)
    _flush_all()
    if store == "jsonl":
        stored = (tmp_path / "audit.jsonl").read_text()
    else:
        import psycopg

        with psycopg.connect(url) as conn:
            stored = json.dumps(conn.execute("SELECT * FROM audit_events").fetchall(), default=str)
    assert '"seal"' in stored or "'seal'" in stored or "seal" in stored
    material = ring_from_json(json.loads(ring.read_text())).keys[0].material
    assert material is not None
    for s in (token, token[4:], QUESTION_STATE, base64.b64encode(material).decode(), material.hex()):
        assert s not in stored
    res = cli("audit", "query", "--audit", url, "--op", "unseal", "--json", keystore=ring)
    assert [(e["op"], e["outcome"]) for e in res.json()] == [("unseal", "ok")]
