"""Part 4: the audit log's cost: in-process codec on vs off, the writer's throughput, the sidecar on vs off.

Rows: the in-process codec (below); the writer process's events/s against the store's own limit
(`bench.audit_writer`); the sidecar (one worker each, wrk, interleaved) with the audit log on (its
default SQLite store) vs off (``MRTR_KEYS_AUDIT=off``), seal c=16 req/s and seal batch(100) c=16
items/s, with the events the audited one dropped (from its ``/metrics``).

In-process codec:

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
TARGET = "<= 2.0x"


def _sink(codec: Any) -> Any:
    """The `AuditSink` behind a codec's observer (the codec, or its token core, holds it)."""
    for holder in (codec, getattr(codec, "_core", None)):
        observer = getattr(holder, "_observer", None)
        if observer is not None and hasattr(observer, "sink"):
            return observer.sink
    return None


def run(services: Services, settings: Settings) -> list[Row]:
    name = "local seal+unseal, audit on"
    if not module_available("mrtr_keys.audit.capture.observer"):
        return [Row.missing(PART, name, "n/a (not built): mrtr_keys.audit", target=TARGET)]
    from mrtr_keys import request_state_security
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.keystores.file import FileKeystore

    directory = services.workdir / "audit"
    directory.mkdir()
    ring = directory / "keyring.json"
    create_ring(FileKeystore(ring))
    off = request_state_security(ring, audience=AUDIENCE, audit=False).codec
    on = request_state_security(ring, audience=AUDIENCE, audit=None).codec
    sink = _sink(on)
    if sink is None:
        return [Row.missing(PART, name, "n/a: audit on, but no audit sink found on the codec", target=TARGET)]
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
    row.decide(row.ratio, TARGET)
    if dropped:
        row.status = "MISS"
        row.note += " (events dropped: not a valid comparison)"
    base = Row(PART, "local seal+unseal, audit off", "µs", median(r["audit off"]), spread_of(r["audit off"]))
    base.samples = r["audit off"]
    queued = Row(PART, "local seal+unseal, audit on, queueing only", "µs", median(r["queue only"]))
    queued.spread, queued.anchor = spread_of(r["queue only"]), "audit off"
    queued.ratio = paired_ratio(r["queue only"], r["audit off"])
    queued.note = "the caller's time while the writer runs concurrently; its backlog flushed untimed after"
    from bench import audit_writer

    out = [base, row, queued, *audit_writer.run(services.workdir, settings)]
    return out + _sidecar_rows(services, settings)


def _sidecar_rows(services: Services, settings: Settings) -> list[Row]:
    import base64
    import re
    import urllib.request

    from bench.sidecar_load import BATCH, Scenario, _note, ensure_wrk, lua_script, start_sidecar
    from bench.standin_writer import seal_items

    names = {"seal c=16": ">= 0.9x", f"seal batch({BATCH}) c=16": ">= 0.8x"}
    wrk = ensure_wrk()
    if wrk is None:
        why = "n/a: wrk not installed"
        return [Row.missing(PART, f"sidecar {k}, audit on", why, target=v) for k, v in names.items()]
    on = start_sidecar(services, workers=1, name="audit-on-sidecar")
    off = start_sidecar(services, workers=1, name="audit-off-sidecar", env={"MRTR_KEYS_AUDIT": "off"})
    payload = base64.urlsafe_b64encode(envelope_payload()).rstrip(b"=").decode()
    one = {"audience": AUDIENCE, "payload": payload}
    d = services.workdir
    standin = seal_items(20_000, d)
    rows: list[Row] = []
    for label, path, body, items in (
        ("seal c=16", "/v1/seal", one, 1),
        (f"seal batch({BATCH}) c=16", "/v1/seal/batch", {"items": [one] * BATCH}, BATCH),
    ):
        scen = {
            side: Scenario(
                f"sidecar {label}, audit {side}",
                s.url + path,
                lua_script(d, f"audit-{side}-{items}", body, {"Authorization": f"Bearer {s.secret}"}),
                16,
                items,
            )
            for side, s in (("on", on), ("off", off))
        }
        r_on, r_off, r_beside, rates = _rounds(wrk, scen, settings, d, standin, items)
        unit = "items/s" if items > 1 else "req/s"
        a = [r.rps * items for r in r_on]
        b = [r.rps * items for r in r_off]
        base = Row(PART, scen["off"].name, unit, median(b), spread_of(b), note=_note(r_off), samples=b)
        row = Row(PART, scen["on"].name, unit, median(a), spread_of(a), base.name, paired_ratio(a, b))
        row.samples = a
        with urllib.request.urlopen(on.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        m = re.search(r"^mrtr_sidecar_audit_dropped_total (\S+)$", metrics, re.M)
        slowed = re.search(r"^mrtr_sidecar_audit_slowed_total (\S+)$", metrics, re.M)
        dropped = float(m.group(1)) if m else float("nan")
        row.note = (
            f"{_note(r_on)}; audit events dropped so far {dropped:,.0f}, callers slowed "
            f"{float(slowed.group(1)) if slowed else float('nan'):,.0f}; 1 worker each"
        )
        row.decide(row.ratio, names[label])
        if dropped != 0:
            row.status = "MISS"
        if any(r.errors for r in r_on + r_off):
            row.status = "MISS"
            row.note += " (non-2xx or socket errors: numbers not valid)"
        rows += [base, row, *_colocation_rows(scen, unit, items, a, b, r_beside, rates)]
    return rows


def _rounds(
    wrk: str, scen: dict[str, Any], settings: Settings, directory: Any, standin: list[Any], items: int
) -> tuple[list[Any], list[Any], list[Any], list[float]]:
    """Interleaved rounds of on and off (A B, B A, ...); after each, off again beside a stand-in
    writer process fed the events/s the on run just reached (`bench.standin_writer`)."""
    from bench.sidecar_load import run_wrk
    from bench.standin_writer import StandIn

    r_on: list[Any] = []
    r_off: list[Any] = []
    r_beside: list[Any] = []
    rates: list[float] = []

    def run(side: str) -> Any:
        return run_wrk(wrk, scen[side].url, scen[side].script, connections=16, seconds=settings.wrk_seconds)

    for r in range(settings.wrk_repeats):
        for side, sink in [("on", r_on), ("off", r_off)] if r % 2 == 0 else [("off", r_off), ("on", r_on)]:
            sink.append(run(side))
        writer = StandIn(directory, standin, r_on[-1].rps * items)
        try:
            r_beside.append(run("off"))
        finally:
            writer.stop()
        rates.append(writer.achieved)
    return r_on, r_off, r_beside, rates


def _colocation_rows(
    scen: dict[str, Any],
    unit: str,
    items: int,
    on: list[float],
    off: list[float],
    beside: list[Any],
    rates: list[float],
) -> list[Row]:
    """Split the on/off gap: the writer process's presence on the machine (off beside a stand-in
    writer vs off), and the sidecar's own share (on vs off beside the stand-in)."""
    from bench.sidecar_load import _note

    c = [r.rps * items for r in beside]
    name = f"{scen['off'].name} beside a writer process at the audit-on rate"
    near = Row(PART, name, unit, median(c), spread_of(c), scen["off"].name, paired_ratio(c, off), samples=c)
    near.note = (
        f"{_note(beside)}; a real writer process took {median(rates):,.0f} events/s (fed at the on run's rate, "
        f"{median(on):,.0f} {unit}) from this process: what the writer's work alone costs the sidecar here"
    )
    own = Row(PART, f"{scen['on'].name}, own share", unit, median(on), spread_of(on), name, paired_ratio(on, c))
    own.samples = on
    own.note = "audit on vs off beside the same writer load: queueing and shipping in the sidecar's process"
    return [near, own]
