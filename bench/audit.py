"""Part 4: the in-process codec with its audit log on vs off (default SQLite store beside the ring).

Both codecs come from `mrtr_keys.request_state_security(ring, audience=..., audit=...)`, one
with ``audit=False`` and one with the default store. The audit-on sample includes
`AuditSink.flush()` at the end of its loop, so the background writer's work is paid
inside the measured time (sustained cost, not just the cost of queueing); dropped
events would make the comparison meaningless, so they are counted and reported. Wall
time, interleaved rounds.
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import Settings, envelope_payload
from bench.report import Row, spread_of
from bench.services import AUDIENCE, Services, module_available
from bench.timing import interleaved, median, paired_ratio

PART = "audit"


def _sink(codec: Any) -> Any:
    """The `AuditSink` behind a codec's observer (the codec, or its token core, holds it)."""
    for holder in (codec, getattr(codec, "_core", None)):
        observer = getattr(holder, "_observer", None)
        if observer is not None and hasattr(observer, "sink"):
            return observer.sink
    return None


def run(services: Services, settings: Settings) -> list[Row]:
    name = "local seal+unseal, audit on"
    if not module_available("mrtr_keys.audit.observer"):
        return [Row.missing(PART, name, "n/a (not built): mrtr_keys.audit", target="<= 1.1x")]
    from mrtr_keys import request_state_security
    from mrtr_keys.keystores.file import FileKeystore
    from mrtr_keys.ring.create import create_ring

    directory = services.workdir / "audit"
    directory.mkdir()
    ring = directory / "keyring.json"
    create_ring(FileKeystore(ring))
    off = request_state_security(ring, audience=AUDIENCE, audit=False).codec
    on = request_state_security(ring, audience=AUDIENCE, audit=None).codec
    sink = _sink(on)
    if sink is None:
        return [Row.missing(PART, name, "n/a: audit on, but no audit sink found on the codec", target="<= 1.1x")]
    payload = envelope_payload()
    dropped0, written0 = sink.dropped, sink.written

    def loop_off(n: int) -> None:
        seal, unseal = off.seal, off.unseal
        for _ in range(n):
            unseal(seal(payload))

    def loop_queue_only(n: int) -> None:
        seal, unseal = on.seal, on.unseal
        for _ in range(n):
            unseal(seal(payload))

    def loop_on(n: int) -> None:
        seal, unseal = on.seal, on.unseal
        for _ in range(n):
            unseal(seal(payload))
        sink.flush(60.0)

    inner = 200 if settings.quick else 5000
    r = interleaved(
        {"audit off": loop_off, "audit on": loop_on, "queue only": loop_queue_only},
        repeats=settings.repeats,
        inner=inner,
        clock=time.perf_counter,
        after={"queue only": lambda: sink.flush(60.0)},
    )
    dropped = sink.dropped - dropped0
    written = sink.written - written0
    row = Row(PART, name, "µs", median(r["audit on"]), spread_of(r["audit on"]), "audit off")
    row.ratio = paired_ratio(r["audit on"], r["audit off"])
    row.samples = r["audit on"]
    row.note = (
        f"wall time incl. flush; {written:,} events written, {dropped} dropped; store {sink.store.url.split(':')[0]}"
    )
    row.decide(row.ratio, "<= 1.1x")
    if dropped:
        row.status = "MISS"
        row.note += " (events dropped: not a valid comparison)"
    base = Row(PART, "local seal+unseal, audit off", "µs", median(r["audit off"]), spread_of(r["audit off"]))
    base.samples = r["audit off"]
    queued = Row(PART, "local seal+unseal, audit on, queueing only", "µs", median(r["queue only"]))
    queued.spread, queued.anchor = spread_of(r["queue only"]), "audit off"
    queued.ratio = paired_ratio(r["queue only"], r["audit off"])
    queued.note = "the caller's time while the writer runs concurrently; its backlog flushed untimed after"
    return [base, row, queued]
