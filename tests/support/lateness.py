"""How late a busy host lets a woken thread run: the allowance a time bound needs on a shared machine.

A bound such as "within 3 intervals" or "within the 1 s deadline (+0.5 s)" holds on a quiet host; on one
running the suite's six workers on two cores, the thread that must act at the deadline (and the one it
wakes) can wait for a core and the interpreter lock for up to a second. No deadline can bound that, so a
test adds what `Relay` saw during the same stretch to its bound: on a quiet host that is milliseconds, and
the bound is the claim itself.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

NAP = 0.01
"""Seconds from one hand-off to the next."""
NOTABLE = 0.005
"""Overruns above this many seconds are kept, with their time, for `overrun_between`."""


class Relay:
    """How late a thread runs when another thread wakes it at a deadline, measured back to back until `stop`.

    Whatever acts at a deadline takes that path: a timer thread (a store's watchdog, a watcher's interval, the
    lock or queue a caller waits on with a timeout) wakes at the deadline, and the thread it releases must then
    get a core and the interpreter.
    Here a timer thread sleeps until a due time `NAP` s ahead and sets an event that the probe thread waits on;
    `overrun` is the most the probe thread woke after its due time: two wake-ups in a row, as a refusal has,
    which no deadline can bound. A thread that only sleeps measures one of them: in one CI run a replay store
    refusal came 1.45 s after its deadline while such a thread overslept 0.82 s at most."""

    def __init__(self, *, history: int = 0) -> None:
        self.overrun = 0.0
        self.history: deque[tuple[float, float]] = deque(maxlen=history or None)
        """With `history`: the last that many overruns above `NOTABLE`, as (monotonic due time, seconds)."""
        self._keep = history > 0
        self._due: queue.SimpleQueue[tuple[float, threading.Event] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._timer, self._probe)]
        for t in self._threads:
            t.start()

    def _timer(self) -> None:
        while (item := self._due.get()) is not None:
            due, woken = item
            time.sleep(max(0.0, due - time.monotonic()))
            woken.set()

    def _probe(self) -> None:
        while not self._stop.is_set():
            due, woken = time.monotonic() + NAP, threading.Event()
            self._due.put((due, woken))
            woken.wait()
            late = time.monotonic() - due
            self.overrun = max(self.overrun, late)
            if self._keep and late > NOTABLE:
                self.history.append((due, late))
        self._due.put(None)

    def overrun_between(self, start: float, end: float) -> float:
        """The largest overrun kept (`history`) whose due time lies in [`start`, `end`] (monotonic seconds)."""
        return max((late for due, late in list(self.history) if start <= due <= end), default=0.0)

    def stop(self) -> float:
        """Stop probing; the largest overrun seen (seconds)."""
        self._stop.set()
        for t in self._threads:
            t.join(10)
        return self.overrun

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
