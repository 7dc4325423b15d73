"""Store rows from queued items: times and durations come out exactly as the event helpers define them."""

from __future__ import annotations

import math
import random

from hypothesis import example, given
from hypothesis import strategies as st

from mrtr_keys.audit.capture.items import AuditItem, item_rows, round_ms
from mrtr_keys.audit.events import format_ts
from mrtr_keys.audit.writing.fingerprint import Fingerprinter

TIME, DURATION = 0, 10  # positions in a store row (`mrtr_keys.audit.events.FIELDS` order)


def _rows(times: list[float], durations: list[float | None]) -> list[tuple[object, ...]]:
    items = [
        AuditItem("seal", "ok", "abcd1234", None, None, ts, "svc", 1, "web", dur)
        for ts, dur in zip(times, durations, strict=True)
    ]
    return item_rows(items, "host:1:x", Fingerprinter(b"k" * 32), None, "w", 1)


def _edges(sec: int) -> list[float]:
    """Times at and just below the ends of second `sec` (where truncation to microseconds and
    float rounding can disagree)."""
    up = float(sec + 1)
    return [
        float(sec),
        sec + 0.5,
        sec + 0.999999,
        sec + 0.9999995,
        sec + 0.99999999,
        math.nextafter(up, 0.0),
        math.nextafter(float(sec), up),
    ]


def test_row_times_are_format_ts_over_many_random_times_and_second_edges() -> None:
    rng = random.Random(15)
    secs = [0, 1, 1_700_000_000, 1_798_761_599, 2**31 - 1, 2**32, 253_402_300_798]  # ... to 9999-12-31T23:59:58
    times = [t for s in secs for t in _edges(s)]
    times += [rng.uniform(0, 4_102_444_800) for _ in range(20_000)]  # 1970 to 2100
    base = 1_780_000_000.0
    times += sorted(base + rng.random() * 3 for _ in range(5_000))  # many per second, as the writer sees them
    times += [base + n / 1_000_000 for n in range(999_000, 1_001_000)]  # every microsecond around a second's end
    durations: list[float | None] = [None] * len(times)
    assert [row[TIME] for row in _rows(times, durations)] == [format_ts(t) for t in times]


@given(st.floats(min_value=0, max_value=2**35, allow_nan=False))
@example(1_780_000_000.999999)
@example(math.nextafter(1_780_000_001.0, 0.0))
def test_row_time_is_format_ts(ts: float) -> None:
    assert _rows([ts], [None])[0][TIME] == format_ts(ts)


def _same(a: object, b: object) -> bool:
    """Equal as stored and hashed: same type and `repr` (so 0.0 vs -0.0 and NaN are compared too)."""
    return type(a) is type(b) and repr(a) == repr(b)


@given(st.one_of(st.floats(), st.integers(min_value=-(10**12), max_value=10**12)))
@example(0.0005)
@example(1.0005)
@example(2.675)
@example(0.0)
@example(-0.0)
@example(-0.0001)
@example(999_999_999.9995)
@example(1e9)
@example(5e-324)
def test_durations_are_stored_as_round_to_3_places(duration: float) -> None:
    want = round(float(duration), 3)
    assert _same(round_ms(duration), want)
    assert _same(_rows([1.0], [duration])[0][DURATION], want)


def test_round_ms_matches_round_on_values_next_to_ties() -> None:
    # Products just either side of n + 0.5, where the fast path must step aside.
    rng = random.Random(3)
    values = []
    for _ in range(20_000):
        tie = (rng.randrange(0, 10**9) + 0.5) / 1000
        values += [tie, math.nextafter(tie, 0.0), math.nextafter(tie, math.inf), tie * (1 + 1e-12)]
    values += [rng.uniform(0, 1e9) for _ in range(20_000)] + [rng.expovariate(1.0) for _ in range(20_000)]
    assert all(_same(round_ms(v), round(v, 3)) for v in values)


def test_long_accepted_tokens_get_their_fingerprint_but_no_place_in_the_cache() -> None:
    """The writer's fingerprint cache (a seal and its unseal in one batch share one HMAC) holds only
    tokens up to CACHE_TOKEN_CHARS, so its memory stays small whatever the tokens' size."""
    from mrtr_keys.audit.capture.items import CACHE_TOKEN_CHARS

    fp = Fingerprinter(b"k" * 32)
    short, long = "mk1." + "A" * 400, "mk1." + "A" * (4 * CACHE_TOKEN_CHARS)
    items = [
        AuditItem(op, "ok", "abcd1234", t, None, 1.0, "svc", 1, "web", None)
        for t in (short, long)
        for op in ("seal", "unseal")
    ]
    cache: dict[str, str] = {}
    rows = item_rows(items, "host:1:x", fp, cache, "w", 1)
    assert [r[8] for r in rows] == [fp.fingerprint(short)] * 2 + [fp.fingerprint(long)] * 2
    assert list(cache) == [short]
