"""Prometheus metrics of the sidecar (served at ``GET /metrics``; no secret needed, none revealed).

* ``mrtr_sidecar_requests_total{op, audience, outcome}``: one per seal or unseal operation (a batch item
  counts as one); ``audience`` is ``-`` unless the caller was granted it, so unauthenticated traffic
  cannot create label values.
* ``mrtr_sidecar_request_duration_seconds{route}``: latency per HTTP request, histogram.
* ``mrtr_sidecar_ring_generation``: the loaded key ring's generation.
* ``mrtr_sidecar_ring_stale``: 1 while the stored ring cannot be loaded and the last good one is serving.
* ``mrtr_sidecar_reloads_total{result}``: keystore / registry reload attempts (``switched``, ``failed``).

Each worker process keeps its own counters (``--workers N`` gives N independent series; scrape the
workers separately or run one worker per sidecar, the usual layout).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

OUTCOMES = ("ok", "rejected", "unauthorized", "forbidden", "invalid", "too_large", "unavailable", "error")
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5)
"""Seconds; the local codec answers in tens of microseconds, remote backends in milliseconds."""
CONTENT_TYPE = CONTENT_TYPE_LATEST


class SidecarMetrics:
    """The sidecar's collectors in their own registry (so several apps in one process never clash)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "mrtr_sidecar_requests",
            "Seal and unseal operations by operation, audience and outcome.",
            ("op", "audience", "outcome"),
            registry=self.registry,
        )
        self._latency = Histogram(
            "mrtr_sidecar_request_duration_seconds",
            "HTTP request latency of the sealing routes (seconds).",
            ("route",),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.generation = Gauge(
            "mrtr_sidecar_ring_generation", "Generation of the key ring in use.", registry=self.registry
        )
        self.stale = Gauge(
            "mrtr_sidecar_ring_stale",
            "1 while the stored key ring cannot be loaded and the last good one is in use.",
            registry=self.registry,
        )
        self.reloads = Counter(
            "mrtr_sidecar_reloads", "Key ring and client registry reloads.", ("result",), registry=self.registry
        )
        self._count_children: dict[tuple[str, str, str], Counter] = {}
        self._latency_children: dict[str, Histogram] = {}

    def count(self, op: str, audience: str, outcome: str, n: int = 1) -> None:
        """Add `n` operations; label children are cached (the hot path skips `labels()`)."""
        key = (op, audience, outcome)
        child = self._count_children.get(key)
        if child is None:
            child = self._count_children[key] = self._requests.labels(op, audience, outcome)
        child.inc(n)

    def observe(self, route: str, seconds: float) -> None:
        child = self._latency_children.get(route)
        if child is None:
            child = self._latency_children[route] = self._latency.labels(route)
        child.observe(seconds)

    def render(self) -> bytes:
        """The text exposition format (``text/plain; version=0.0.4``)."""
        return generate_latest(self.registry)
