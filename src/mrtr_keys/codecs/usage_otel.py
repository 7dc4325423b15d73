"""OpenTelemetry metrics of the seal counts of library codecs (`mrtr_keys.codecs.usage`).

Two asynchronous counters on the meter ``mrtr-keys``, read from the in-process tallies when the application's
`MeterProvider` collects (nothing on the hot path):

* ``mrtr_keys.seals`` (unit ``{token}``), attributes ``mrtr_keys.kid`` and ``mrtr_keys.ring_id``: tokens this
  process sealed per kid;
* ``mrtr_keys.unseals`` (unit ``{token}``), the same plus ``mrtr_keys.outcome`` (``ok``, ``rejected``): tokens
  it opened or refused; ``mrtr_keys.kid`` is ``unknown`` for a token whose kid the ring does not hold.

They match the sidecar's ``mrtr_sidecar_seals_total{kid}`` and ``mrtr_sidecar_unseals_total{kid, outcome}``.
Needs ``opentelemetry-api`` (the ``otel`` extra; the MCP SDK depends on it) and a provider set by the
application (`opentelemetry.metrics.set_meter_provider`); until then the API's proxy meter reports nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from mrtr_keys.codecs.usage import UNKNOWN, rings

METER_NAME = "mrtr-keys"
_installed = False
_lock = threading.Lock()


def install() -> bool:
    """Register the two counters on the global meter provider, once per process. False without the API."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from opentelemetry import metrics
        except ImportError:  # pragma: no cover - the otel extra is not installed
            return False
        from mrtr_keys.version import __version__

        meter = metrics.get_meter(METER_NAME, __version__)
        meter.create_observable_counter(
            "mrtr_keys.seals", callbacks=[_seals], unit="{token}", description="Tokens this process sealed, by kid."
        )
        meter.create_observable_counter(
            "mrtr_keys.unseals",
            callbacks=[_unseals],
            unit="{token}",
            description="Tokens this process opened (ok) or refused (rejected), by kid.",
        )
        _installed = True
        return True


def _seals(options: Any) -> Iterator[Any]:
    from opentelemetry.metrics import Observation

    for usage in rings():
        for tally in usage.tallies():
            if tally.kid != UNKNOWN:
                yield Observation(tally.seals, {"mrtr_keys.kid": tally.kid, "mrtr_keys.ring_id": usage.ring_id})


def _unseals(options: Any) -> Iterator[Any]:
    from opentelemetry.metrics import Observation

    for usage in rings():
        for tally in usage.tallies():
            base = {"mrtr_keys.kid": tally.kid, "mrtr_keys.ring_id": usage.ring_id}
            if tally.kid != UNKNOWN:
                yield Observation(tally.unseals, {**base, "mrtr_keys.outcome": "ok"})
            yield Observation(tally.rejections, {**base, "mrtr_keys.outcome": "rejected"})
