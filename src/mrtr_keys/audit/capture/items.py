"""`AuditItem`: what a producer (codec observer, sidecar, SDK capture) queues for the audit writer.

An item is the raw material of one event: the token itself rather than its fingerprint, and the
POSIX time rather than its text. The writer (a thread, or the writer process,
`mrtr_keys.audit.writing.writer.child`) turns items into store rows with `item_rows`, the one place
that fingerprints and formats them. This module imports only the standard library, so the writer
process loads it in microseconds.

On the way to the writer process a batch travels as columns (`to_columns`: one tuple per field,
`marshal`-encoded), not as one object per event: ten tuples for any number of events.
"""

from __future__ import annotations

from datetime import UTC, datetime
from functools import partial
from typing import Any, NamedTuple

OK = "ok"
REJECTED = "rejected"


class AuditItem(NamedTuple):
    """One queued event (see the module docstring). The field order is the wire's column order."""

    op: str
    outcome: str
    kid: str | None
    token: str | None
    """The token as the codec saw it (cut to the token cap + 1 characters); fingerprinted by the
    writer, never stored."""
    reason: str | None
    time: float
    """POSIX seconds."""
    audience: str | None
    generation: int | None
    client: str | None
    duration_ms: float | None

    def rejected(self, reason: str, at: float | None = None) -> AuditItem:
        """This item as ``rejected`` with `reason` (an SDK rejection after our unseal; `at`: a
        new time for a rejection recorded as an event of its own)."""
        return self._replace(outcome=REJECTED, reason=reason, time=self.time if at is None else at)


new_item: Any = partial(tuple.__new__, AuditItem)
"""``new_item((op, outcome, kid, token, reason, time, audience, generation, client, duration_ms))``:
an `AuditItem` built by one C call (the producers' hot path; the class's own constructor is a
Python function, several times slower). The tuple must hold the ten fields in order."""

CACHE_TOKEN_CHARS = 1_024
"""Longest token `item_rows` keeps in its fingerprint cache (typical tokens are a few hundred
characters; a cache of long ones would hold megabytes for one saved HMAC each)."""

ITEM_OVERHEAD_BYTES = 600
"""What one queued item costs in memory beyond its token's characters (the tuple, its floats, the
queue's slot, a share of the frame on its way to the writer): a conservative round figure used by
the sink's byte bound."""


def item_bytes(item: AuditItem) -> int:
    """The memory one queued item is charged for (bytes): `ITEM_OVERHEAD_BYTES` + its token's length."""
    token = item.token
    return ITEM_OVERHEAD_BYTES + (len(token) if token is not None else 0)


def to_columns(items: list[AuditItem]) -> tuple[tuple[Any, ...], ...]:
    """`items` as one tuple per field (what `marshal` ships to the writer process)."""
    return tuple(zip(*items, strict=True))


def item_values(rows: Any, instance: str, fingerprinter: Any) -> list[tuple[object, ...]]:
    """Items -> event value tuples in `mrtr_keys.audit.events.FIELDS` order (see `item_rows`)."""
    return [r[:11] for r in item_rows(rows, instance, fingerprinter, None, "", 1)]


def item_rows(
    rows: Any, instance: str, fingerprinter: Any, cache: dict[str, str] | None, writer: str, seq: int
) -> list[tuple[object, ...]]:
    """Items (any iterable of 10-tuples in `AuditItem` field order) -> store rows in SQL column
    order (`FIELDS`, then `writer`, seq numbered from `seq`, and empty ``prev_hash`` and ``hash``
    for `mrtr_keys.audit.writing.chain.ChainWriter.link_rows` to fill in), fingerprinting the tokens.

    `cache` (token -> fingerprint, for tokens a codec minted or accepted) saves the second HMAC
    when a batch holds both the seal and the unseal of one token; the caller bounds its size.
    Times are formatted as `mrtr_keys.audit.events.format_ts` does, the date and time of day
    once per second of events; durations are rounded as `round_ms` says. One loop, one tuple per
    event: this is the writer's hot path.
    """
    fp_ok = fingerprinter.fingerprint_canonical
    fp_any = fingerprinter.fingerprint
    if cache is None:
        cache = {}
    get = cache.get
    fromtimestamp = datetime.fromtimestamp
    last_sec, prefix = -1, ""
    out: list[tuple[object, ...]] = []
    append = out.append
    for op, outcome, kid, token, reason, ts, audience, generation, client, dur in rows:
        if token is None:
            fp = None
        elif outcome == OK and len(token) <= CACHE_TOKEN_CHARS:
            fp = get(token)
            if fp is None:
                fp = cache[token] = fp_ok(token)
        elif outcome == OK:
            fp = fp_ok(token)
        else:
            fp = fp_any(token)
        sec = int(ts)
        if sec != last_sec:
            # "...T12:34:56.%06dZ": one %-format per event completes it.
            last_sec, prefix = sec, fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S.%%06dZ")
        micros = int((ts - sec) * 1_000_000)
        append(
            (
                prefix % (micros if micros < 999_999 else 999_999),
                instance,
                client,
                audience,
                kid,
                op,
                outcome,
                reason,
                fp,
                generation,
                None if dur is None else round_ms(dur),
                writer,
                seq,
                "",
                "",
            )
        )
        seq += 1
    return out


def round_ms(duration: float) -> float:
    """`duration` (milliseconds) as stored: ``round(float(duration), 3)`` (microsecond resolution).

    The same float, computed without `round`'s decimal conversion when that cannot change it: for
    a float in (0, 1e9), ``y = duration * 1000`` is below 2**40, so within 2**-14 (0.00006) of the
    exact product; when ``y`` is more than 0.0001 from a half-integer, the integer ``n`` nearest
    to it is the one nearest to the exact product (the one `round` picks), and ``n / 1000`` (two
    exact doubles, one correctly rounded division) is the double nearest to ``n`` thousandths,
    which is what `round` returns. Anything else (an int, zero or -0.0, a negative, NaN, infinity,
    a product within 0.0001 of a tie) goes to `round`.
    """
    if duration.__class__ is float and 0.0 < duration < 1e9:
        y = duration * 1000.0
        n = round(y)
        if -0.4999 < y - n < 0.4999:
            return n / 1000
    return round(float(duration), 3)
