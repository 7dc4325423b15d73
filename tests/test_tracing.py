"""OpenTelemetry spans (deliverable 2), read back from the OTel SDK's in-memory exporter.

A real `MCPServer` with the local codec and an in-memory `Client`: our ``mrtr_keys.seal`` and
``mrtr_keys.unseal`` spans are children of the MCP SDK's ``tools/call provision`` span (same
trace), carry kid / audience / outcome / reason, and no attribute holds a token, a payload or
key material. Rotation steps, reloads and keystore reads have their spans too.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp.shared.exceptions import MCPError
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mrtr_keys.changes.rotation import run_step
from mrtr_keys.errors import RotationError
from mrtr_keys.example.app import build_server
from mrtr_keys.factory import request_state_security
from mrtr_keys.keystores.file import FileKeystore
from tests.e2e.servers import first_round, retry_round, text_of

pytestmark = pytest.mark.e2e


class _Switch(SimpleSpanProcessor):
    """Exports only while a test listens, so the provider (global, set once) costs nothing afterwards."""

    on = False

    def on_end(self, span: ReadableSpan) -> None:
        if _Switch.on:
            super().on_end(span)


_EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(_Switch(_EXPORTER))
        trace.set_tracer_provider(provider)
    _EXPORTER.clear()
    _Switch.on = True
    try:
        yield _EXPORTER
    finally:
        _Switch.on = False
        _EXPORTER.clear()


def ours(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_seal_and_unseal_are_children_of_the_sdk_span(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    ring_path = tmp_path / "keyring.json"
    from mrtr_keys.changes.create import create_ring

    create_ring(FileKeystore(ring_path))
    ring = FileKeystore(ring_path).load()
    kid = ring.primary.kid
    mcp = build_server(request_state_security(ring_path, audience="provisioner"))
    first = anyio.run(first_round, mcp)
    state = first.request_state
    assert state is not None
    done = anyio.run(retry_round, mcp, state)
    assert "eu-west-1" in text_of(done)

    by_id = {s.context.span_id: s for s in spans.get_finished_spans()}
    seal, unseal = ours(spans, "mrtr_keys.seal"), ours(spans, "mrtr_keys.unseal")
    assert len(seal) == 1 and len(unseal) == 1
    for span in (seal[0], unseal[0]):
        assert span.parent is not None
        parent = by_id[span.parent.span_id]
        assert parent.name == "tools/call provision" and parent.context.trace_id == span.context.trace_id
        assert attrs(span) == {
            "mrtr_keys.codec": "local",
            "mrtr_keys.audience": "provisioner",
            "mrtr_keys.kid": kid,
            "mrtr_keys.outcome": "ok",
        }

    # A token under a key the ring no longer knows: refused, with the codec's reason, under the SDK span.
    spans.clear()
    other = tmp_path / "other.json"
    create_ring(FileKeystore(other))
    foreign = request_state_security(other, audience="provisioner").codec.seal(b"{}")
    with pytest.raises(MCPError):
        anyio.run(retry_round, mcp, foreign)
    (refused,) = ours(spans, "mrtr_keys.unseal")
    a = attrs(refused)
    assert a["mrtr_keys.outcome"] == "rejected" and a["mrtr_keys.reason"] == "unknown kid"
    assert a["mrtr_keys.kid"] == FileKeystore(other).load().primary.kid
    assert refused.status.status_code is trace.StatusCode.ERROR
    assert by_id.get(refused.parent.span_id) is None  # a new request: its own SDK span
    names = {s.name for s in spans.get_finished_spans()}
    assert "tools/call provision" in names

    # Never a secret: no attribute value holds the token, the state or key material.
    material = base64.b64encode(ring.primary.material or b"").decode()
    for span in spans.get_finished_spans():
        for value in attrs(span).values():
            assert foreign not in str(value) and state not in str(value) and material not in str(value)


def test_rotation_steps_reload_and_keystore_reads(tmp_path: Path, spans: InMemorySpanExporter) -> None:
    path = tmp_path / "keyring.json"
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.codecs.local import LocalAESGCMCodec

    create_ring(FileKeystore(path))
    codec = LocalAESGCMCodec(path, audience="billing")
    spans.clear()
    began = run_step(FileKeystore(path), "begin")
    (change,) = ours(spans, "mrtr_keys.ring.change")
    assert attrs(change) == {
        "mrtr_keys.op": "begin",
        "mrtr_keys.keystore": f"file://{path}",
        "mrtr_keys.outcome": "changed",
        "mrtr_keys.generation": 2,
        "mrtr_keys.kid": began.details["new"],
    }
    (load,) = ours(spans, "mrtr_keys.keystore.load")
    assert load.parent is not None and load.parent.span_id == change.context.span_id
    assert attrs(load)["mrtr_keys.generation"] == 1

    spans.clear()
    with pytest.raises(RotationError, match="not sealing yet"):
        run_step(FileKeystore(path), "retire")
    (refused,) = ours(spans, "mrtr_keys.ring.change")
    assert attrs(refused)["mrtr_keys.outcome"] == "refused" and attrs(refused)["mrtr_keys.reason"] == "RotationError"

    spans.clear()
    assert codec.reload() is True
    (reload,) = ours(spans, "mrtr_keys.reload")
    assert attrs(reload) == {
        "mrtr_keys.codec": "local",
        "mrtr_keys.generation": 1,
        "mrtr_keys.outcome": "switched",
        "mrtr_keys.to_generation": 2,
    }
    (read,) = ours(spans, "mrtr_keys.keystore.load")
    assert read.parent is not None and read.parent.span_id == reload.context.span_id
