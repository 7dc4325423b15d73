"""Interleaved timing: every subject and its anchor run in alternating order, repeat after repeat.

On a shared 2-core machine absolute times drift by tens of percent within a minute, so a
subject is only ever compared with an anchor timed in the same round: rounds run the
subjects in forward then reverse order (A B C, C B A, ...), each round gives one sample per
subject, and a ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

Loop = Callable[[int], None]
"""A callable that performs the measured operation `n` times."""


def interleaved(
    subjects: Mapping[str, Loop],
    *,
    repeats: int,
    inner: int,
    warmup: int | None = None,
    clock: Callable[[], float] = time.thread_time,
    after: Mapping[str, Callable[[], None]] | None = None,
) -> dict[str, list[float]]:
    """Time each loop `repeats` times, interleaved; returns name -> per-op microseconds per round.

    `clock` is the calling thread's CPU time by default: on a shared machine it counts the
    work done, not the time spent waiting for a core another process holds. Pass
    `time.perf_counter` (wall time) when the loop waits on a server. The garbage collector
    is paused inside each timed loop (as `timeit` does) and run between them. `after[name]`,
    if given, runs untimed after each of that subject's loops (e.g. to drain a queue).
    """
    names = list(subjects)
    for name in names:
        subjects[name](warmup if warmup is not None else max(1, inner // 10))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            loop = subjects[name]
            gc.collect()
            gc.disable()
            try:
                start = clock()
                loop(inner)
                elapsed = clock() - start
            finally:
                gc.enable()
            samples[name].append(elapsed / inner * 1e6)
            if after and name in after:
                after[name]()
    return samples


def pair(
    subject: Loop, anchor: Loop, *, rounds: int, inner: int, clock: Callable[[], int] = time.thread_time_ns
) -> tuple[list[float], list[float]]:
    """Per-op microseconds of `subject` and `anchor`, each timed `rounds` times back to back in alternating
    order (AB, BA, ...), with the garbage collector paused for the whole run (loops that make no cycles).

    For a difference of a few per cent: short samples (a few ms) next to each other see the same machine,
    where `interleaved`'s longer rounds, each after a full collection, let a shared host's load come and
    go between the two."""
    subject(max(1, inner)), anchor(max(1, inner))
    out: tuple[list[float], list[float]] = ([], [])
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                loop = (subject, anchor)[i]
                start = clock()
                loop(inner)
                out[i].append((clock() - start) / inner / 1e3)
    finally:
        gc.enable()
    return out


def paired_ratio(subject: Sequence[float], anchor: Sequence[float]) -> float:
    """Median over rounds of subject[i] / anchor[i] (both from the same round)."""
    return statistics.median(s / a for s, a in zip(subject, anchor, strict=True))


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)
