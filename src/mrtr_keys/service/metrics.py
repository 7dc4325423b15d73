"""Prometheus metrics of the sidecar (served at ``GET /metrics``; no secret needed, none revealed).

* ``mrtr_sidecar_requests_total{op, audience, outcome}``: one per seal or unseal operation (a batch item
  counts as one); ``audience`` is ``-`` unless the caller was granted it, so unauthenticated traffic
  cannot create label values.
* ``mrtr_sidecar_request_duration_seconds{route}``: latency per HTTP request, histogram.
* ``mrtr_sidecar_ring_generation``: the loaded key ring's generation.
* ``mrtr_sidecar_ring_stale``: 1 while the stored ring cannot be loaded and the last good one is serving.
* ``mrtr_sidecar_ring_watcher_last_check_timestamp_seconds``: when the ring watcher last completed a
  keystore check; ``mrtr_sidecar_ring_watcher_stuck``: 1 while none has completed for 3 intervals.
* ``mrtr_sidecar_reloads_total{result}``: keystore / registry reload attempts (``switched``, ``failed``).
* ``mrtr_sidecar_fenced_out_total``: operations served on the last good ring after the lease ran out and the
  keystore check failed (`mrtr_keys.codecs.fence`).
* ``mrtr_sidecar_rejections_total{reason}``: tokens the codec refused, by its reason code (``unknown kid``,
  ``retired kid``, ``seal`` (tag mismatch), ``malformed``, ``too long``, ``version``, ``vault refused``).
* ``mrtr_sidecar_ring_phase``: rotation phase of the loaded ring (0 idle, 1 begun, 2 promoted);
  ``mrtr_sidecar_ring_loaded_timestamp_seconds``: when this process switched to that generation;
  ``mrtr_sidecar_build_info{version}``: 1.
* ``mrtr_sidecar_audit_queued``, ``mrtr_sidecar_audit_dropped_total``, ``mrtr_sidecar_audit_slowed_total``:
  audit events waiting for the writer, events dropped (queue at its bound with the writer stalled, or
  lost with a writer process), and callers made to wait for the writer (read at scrape time; absent
  with audit off).
  A growing ``queued`` means the writer is behind: the queue is bounded in events (see docs/audit.md),
  and its high-water mark is most of the sidecar's resident memory beyond the baseline.
* ``mrtr_sidecar_seals_total{kid}``, ``mrtr_sidecar_unseals_total{kid, outcome}`` (``ok``, ``rejected``): this
  process's seals, unseals and refused tokens per kid (`mrtr_keys.codecs.usage`); ``kid`` is a kid of the loaded
  ring, or ``unknown`` for a token whose kid the ring does not hold, so no token can add a label value.
* ``mrtr_sidecar_key_seals{kid, state}``, ``mrtr_sidecar_key_seal_budget{kid, state}`` and
  ``mrtr_sidecar_key_budget_used_ratio{kid, state}``: each usable key's fleet-wide seals as the presence store
  last said (never below the truth; this process's own count without a presence store), its seal budget, and
  the fraction used (`mrtr_keys.fleet.usage`; the alerts ``MrtrKeysSealBudgetHalfUsed`` and
  ``MrtrKeysSealBudgetSpent``).
* ``mrtr_sidecar_store_up{store}`` (``audit``, ``replay``): 0 while that store counts as down (writes
  failing or unacknowledged for 1 s; calls failing), and
  ``mrtr_sidecar_store_down_since_timestamp_seconds{store}``: since when (0 while up).

Each worker process keeps its own counters (``--workers N`` gives N independent series; scrape the
workers separately or run one worker per sidecar, the usual layout).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from mrtr_keys.errors import MrtrKeysError
from mrtr_keys.version import __version__

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
        self.loaded_at = Gauge(
            "mrtr_sidecar_ring_loaded_timestamp_seconds",
            "When this process started serving the loaded generation (Unix time, seconds).",
            registry=self.registry,
        )
        self.loaded_at.set_to_current_time()
        self.reloads = Counter(
            "mrtr_sidecar_reloads", "Key ring and client registry reloads.", ("result",), registry=self.registry
        )
        for result in ("switched", "failed"):  # exported as 0 from the start, so rate() and alerts see them
            self.reloads.labels(result)
        self.fenced = Counter(
            "mrtr_sidecar_fenced_out",
            "Operations served on the last good key ring after the self-fencing lease ran out and the keystore "
            "check failed (mrtr_keys.codecs.fence).",
            registry=self.registry,
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

    def watch_audit(self, sink: Any) -> None:
        """Export `sink`'s ``queued`` and ``dropped`` (read at scrape time, nothing on the hot path)."""
        self.registry.register(_AuditCollector(sink))

    def watch_stores(self, down: Callable[[], dict[str, float | None]]) -> None:
        """Export ``mrtr_sidecar_store_up{store}`` and ``mrtr_sidecar_store_down_since_timestamp_seconds{store}``
        for the audit and replay stores, from `down()` (store -> POSIX time it went down), at scrape time."""
        self.registry.register(_StoresCollector(down))

    def watch_ring(self, ring: Any) -> None:
        """Export the phase, the load time and the codec rejections of `ring` (a `RingState`), and the wrapping
        key's checks (`mrtr_keys.codecs.kek.KekCollector`), at scrape time."""
        from mrtr_keys.codecs.kek import KekCollector

        self.registry.register(_RingCollector(ring))
        self.registry.register(KekCollector("mrtr_sidecar"))  # type: ignore[arg-type]

    def watch_watcher(self, watcher: Any) -> None:
        """Export the ring watcher's last completed check and whether it is stuck (at scrape time)."""
        self.registry.register(_WatcherCollector(watcher))

    def watch_anchor(self, anchor: Any) -> None:
        """Export the audit anchor loop's last success and failed runs (at scrape time)."""
        self.registry.register(_AnchorCollector(anchor))

    def watch_usage(self, ring: Any, reporter: Callable[[], Any]) -> None:
        """Export the seal, unseal and rejection counts per kid of `ring` (a `RingState`) and each usable key's use
        of its seal budget, from `reporter()` (the `UsageReporter`, or None without a presence store), at scrape
        time."""
        self.registry.register(_UsageCollector(ring, reporter))

    def watch_retention(self, retention: Any) -> None:
        """Export the audit retention loop's last success and records deleted (at scrape time)."""
        self.registry.register(_RetentionCollector(retention))

    def render(self) -> bytes:
        """The text exposition format (``text/plain; version=0.0.4``)."""
        return generate_latest(self.registry)


class _StoresCollector(Collector):
    STORES = ("audit", "replay")

    def __init__(self, down: Callable[[], dict[str, float | None]]) -> None:
        self._down = down

    def collect(self) -> Iterator[GaugeMetricFamily]:
        down = self._down()
        up = GaugeMetricFamily(
            "mrtr_sidecar_store_up", "1 while a store answers, 0 while it counts as down.", labels=["store"]
        )
        since = GaugeMetricFamily(
            "mrtr_sidecar_store_down_since_timestamp_seconds",
            "When a store went down (POSIX seconds; 0 while it is up).",
            labels=["store"],
        )
        for name in self.STORES:
            up.add_metric([name], 0.0 if name in down else 1.0)
            since.add_metric([name], float(down.get(name) or 0.0))
        yield up
        yield since


class _AuditCollector(Collector):
    def __init__(self, sink: Any) -> None:
        self._sink = sink

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        queued = getattr(self._sink, "queued", None)
        if isinstance(queued, int):
            yield GaugeMetricFamily("mrtr_sidecar_audit_queued", "Audit events queued for the writer.", value=queued)
        dropped = getattr(self._sink, "dropped", None)
        if isinstance(dropped, int):
            yield CounterMetricFamily(
                "mrtr_sidecar_audit_dropped", "Audit events dropped (queue full or writer gone).", value=dropped
            )
        slowed = getattr(self._sink, "slowed", None)
        if isinstance(slowed, int):
            yield CounterMetricFamily(
                "mrtr_sidecar_audit_slowed",
                "Requests made to wait for the audit writer (queue past its high-water mark).",
                value=slowed,
            )


class _UsageCollector(Collector):
    """Reads the process's tallies (`mrtr_keys.codecs.usage`) and the reporter's totals at scrape time."""

    def __init__(self, ring: Any, reporter: Callable[[], Any]) -> None:
        self._state, self._reporter = ring, reporter

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        from mrtr_keys.codecs.usage import UNKNOWN, usage_for
        from mrtr_keys.ring.budgets import budget_of

        ring = self._state.ring
        usage = usage_for(ring.ring_id)
        seals = CounterMetricFamily("mrtr_sidecar_seals", "Tokens this process sealed, by kid.", labels=["kid"])
        unseals = CounterMetricFamily(
            "mrtr_sidecar_unseals",
            "Tokens this process opened (ok) or refused (rejected), by kid (unknown: a kid not in the ring).",
            labels=["kid", "outcome"],
        )
        for key in ring.keys:
            tally = usage.kid(key.kid)
            seals.add_metric([key.kid], float(tally.seals))
            unseals.add_metric([key.kid, "ok"], float(tally.unseals))
            unseals.add_metric([key.kid, "rejected"], float(tally.rejections))
        unseals.add_metric([UNKNOWN, "rejected"], float(usage.unknown.rejections))
        yield seals
        yield unseals
        reporter = self._reporter()
        fleet = reporter.totals.get(ring.ring_id, {}) if reporter is not None else None
        labels = ["kid", "state"]
        total = GaugeMetricFamily(
            "mrtr_sidecar_key_seals",
            "Seals of each usable key fleet-wide, as the presence store last said (this process's without one).",
            labels=labels,
        )
        budget = GaugeMetricFamily("mrtr_sidecar_key_seal_budget", "Seal budget of each usable key.", labels=labels)
        ratio = GaugeMetricFamily(
            "mrtr_sidecar_key_budget_used_ratio", "Fraction of its seal budget each usable key has used.", labels=labels
        )
        for key in ring.usable_keys():
            n = fleet[key.kid].seals if fleet is not None and key.kid in fleet else usage.kid(key.kid).seals
            b = budget_of(ring, key)
            for family, value in ((total, n), (budget, b), (ratio, n / b)):
                family.add_metric([key.kid, key.state.value], float(value))
        yield total
        yield budget
        yield ratio


class _WatcherCollector(Collector):
    """Reads the sidecar's `RingWatcher` at scrape time."""

    def __init__(self, watcher: Any) -> None:
        self._watcher = watcher

    def collect(self) -> Iterator[GaugeMetricFamily]:
        last = self._watcher.last_check
        yield GaugeMetricFamily(
            "mrtr_sidecar_ring_watcher_last_check_timestamp_seconds",
            "When the ring watcher last completed a keystore check (Unix time, seconds; 0: never).",
            value=float(last or 0.0),
        )
        yield GaugeMetricFamily(
            "mrtr_sidecar_ring_watcher_stuck",
            "1 while the ring watcher has completed no keystore check for 3 intervals.",
            value=0.0 if self._watcher.stuck_since() is None else 1.0,
        )


class _RetentionCollector(Collector):
    """Reads the sidecar's `mrtr_keys.audit.retention.loop.Retention` at scrape time."""

    def __init__(self, retention: Any) -> None:
        self._retention = retention

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        r = self._retention
        yield GaugeMetricFamily(
            "mrtr_sidecar_audit_retention_last_success_timestamp_seconds",
            "When the audit retention loop last completed a prune (Unix time, seconds; 0: never).",
            value=float(r.last_success or 0.0),
        )
        yield CounterMetricFamily(
            "mrtr_sidecar_audit_retention_deleted",
            "Audit records deleted by the retention loop since the sidecar started.",
            value=float(r.deleted_total),
        )


class _AnchorCollector(Collector):
    """Reads the sidecar's `mrtr_keys.audit.verifying.anchor.Anchorer` at scrape time."""

    def __init__(self, anchor: Any) -> None:
        self._anchor = anchor

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        a = self._anchor
        yield GaugeMetricFamily(
            "mrtr_sidecar_audit_anchor_last_success_timestamp_seconds",
            "When the audit anchor loop last wrote the chains' heads out (Unix time, seconds; 0: never).",
            value=float(a.last_success or 0.0),
        )
        yield CounterMetricFamily(
            "mrtr_sidecar_audit_anchor_failures",
            "Anchor runs whose destination could not be written (sealing went on).",
            value=float(a.failures),
        )


class _RingCollector(Collector):
    """Reads the sidecar's `RingState` at scrape time (nothing on the hot path)."""

    _PHASES = {"idle": 0, "begun": 1, "promoted": 2}

    def __init__(self, ring: Any) -> None:
        self._state = ring
        self._version = __version__

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | InfoMetricFamily]:
        from mrtr_keys.changes.rotation import status

        ring = self._state.ring
        try:
            phase = float(self._PHASES[status(ring, ring.created_at).phase.value])
        except MrtrKeysError:
            phase = -1.0
        yield GaugeMetricFamily(
            "mrtr_sidecar_ring_phase",
            "Rotation phase of the loaded key ring: 0 idle, 1 begun, 2 promoted.",
            value=phase,
        )
        yield InfoMetricFamily(
            "mrtr_sidecar_build", "mrtr-keys version of this sidecar.", value={"version": self._version}
        )
        rejections = CounterMetricFamily(
            "mrtr_sidecar_rejections", "Tokens the codec refused, by reason code.", labels=["reason"]
        )
        for reason, n in sorted(dict(self._state.tap.rejections).items()):
            rejections.add_metric([reason], float(n))
        yield rejections
