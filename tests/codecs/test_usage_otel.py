"""Library codecs' seal counts as OpenTelemetry metrics (issue 36): once the application sets a meter provider,
``mrtr_keys.seals{mrtr_keys.kid}`` and ``mrtr_keys.unseals{mrtr_keys.kid, mrtr_keys.outcome}`` report what this
process sealed, opened and refused, the same counts the sidecar exports to Prometheus."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mcp.server.mcpserver import InvalidRequestState
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from mrtr_keys.changes.create import create_ring
from mrtr_keys.factory import open_codec
from mrtr_keys.keystores.file import FileKeystore

_READER = InMemoryMetricReader()


def _points(ring_id: str) -> dict[str, dict[tuple[str, str], int]]:
    out: dict[str, dict[tuple[str, str], int]] = {}
    data = _READER.get_metrics_data()
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:  # type: ignore[union-attr]
                    a: Any = p.attributes
                    if a.get("mrtr_keys.ring_id") == ring_id:
                        key = (a["mrtr_keys.kid"], a.get("mrtr_keys.outcome", ""))
                        out.setdefault(m.name, {})[key] = p.value  # type: ignore[union-attr]
    return out


def test_seals_unseals_and_rejections_per_kid_once_a_meter_provider_is_set(tmp_path: Path) -> None:
    keystore = FileKeystore(tmp_path / "keyring.json")
    create_ring(keystore)
    codec = open_codec(keystore, audience="billing", reload_every=0)  # before the provider: the API's proxy
    if not isinstance(metrics.get_meter_provider(), MeterProvider):
        metrics.set_meter_provider(MeterProvider(metric_readers=[_READER]))
    kid = codec.ring.primary.kid  # type: ignore[attr-defined]
    for _ in range(3):
        codec.unseal(codec.seal(b"x"))
    with pytest.raises(InvalidRequestState):
        codec.unseal("mk2." + "A" * 48)  # kid 00000000: not in the ring
    points = _points(codec.ring.ring_id)  # type: ignore[attr-defined]
    assert points["mrtr_keys.seals"] == {(kid, ""): 3}
    assert points["mrtr_keys.unseals"] == {(kid, "ok"): 3, (kid, "rejected"): 0, ("unknown", "rejected"): 1}
