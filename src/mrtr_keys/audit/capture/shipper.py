"""Process mode's shipping: queued items to the writer process, mostly from the submitting thread.

A background thread that wakes every few milliseconds to move items costs a busy process far more
than the moving itself: each wake-up wants the interpreter lock back from the thread serving
requests, and while it waits, every release of the lock by that thread (each socket call) wakes
it again (measured on the sidecar: +25 µs of user and +20 µs of system CPU per request, one
context switch per request). So the thread that queues the `ship_at`-th item, or an item when the
oldest has waited `ship_delay` seconds, ships a frame itself (`ship_inline`: columns, `marshal`,
one non-blocking pipe write), and the background thread wakes rarely: every `interval` while it
finds items nobody shipped, backing off to `MAX_WAIT` while the submitting threads ship.

A frame the pipe does not take at once (the writer is behind) stays in the writer's outbox; the
submitting threads then leave everything to the background thread, which waits on the pipe
(`ship_all`), and past the queue's high-water mark callers are slowed (`mrtr_keys.audit.capture.queue`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from mrtr_keys.audit.capture.items import AuditItem, to_columns
from mrtr_keys.audit.capture.queue import AuditQueue, tokens_cost
from mrtr_keys.audit.writing.writer.process import ProcessWriter

FRAME = 1_000
"""Most events per frame sent to the writer process (small frames keep its memory flat)."""
SHIP_AT = 512
"""Queued items at which the submitting thread ships a frame."""
SHIP_DELAY = 0.05
"""Seconds the oldest queued item may wait before the next submitting thread ships it."""
KEEP = 64
"""Newest items a submitting thread leaves queued when it ships, and `SETTLE` the age (seconds) below
which the background thread leaves them: an SDK rejection reported just after our unseal
(`mrtr_keys.audit.capture.sdk_capture`) then still finds its ``unseal ok`` item to replace. The SDK checks the
claims microseconds after the unseal on an idle host; on a loaded one the serving thread can wait tens
of milliseconds for the interpreter lock in between (with 10 ms, a suite run on two busy cores got
``unseal ok`` and ``unseal rejected`` as two events)."""
SETTLE = 0.1
MAX_WAIT = 1.0
"""Longest background sleep (seconds) while the submitting threads do the shipping: after a burst,
its last few items reach the writer within about this long (`AuditSink.flush` ships at once)."""
DRAIN_SLICE = 0.05
"""Seconds the background thread waits on a full pipe before it looks at its other duties."""


def _plain(value: object) -> object:
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return str(value)


def plain_columns(columns: tuple[tuple[object, ...], ...]) -> tuple[tuple[object, ...], ...]:
    """`columns` with every value of a subclass (a `str` enum member, say) turned into the plain
    `str`/`int`/`float` it holds, and anything else into its `str`: what `marshal` writes."""
    return tuple(tuple(map(_plain, column)) for column in columns)


class Shipper:
    """Moves items from `queue` to `process` (see the module docstring); installs itself as the
    queue's ``on_ready``. `wake()` wakes the background thread (which calls `ship_all`)."""

    def __init__(self, queue: AuditQueue, process: ProcessWriter, wake: Callable[[], None], interval: float) -> None:
        self.queue, self.process, self._wake, self.interval = queue, process, wake, interval
        self._lock = threading.Lock()
        self.inline = 0
        """Frames shipped by submitting threads."""
        self._inline_seen = 0
        self._wait = interval
        queue.ship_at, queue.ship_delay, queue.ship_keep = SHIP_AT, SHIP_DELAY, KEEP
        queue.on_ready = self.ship_inline
        queue.on_first = wake  # the first event after a quiet spell reaches the writer within `interval`

    def _send(self, items: list[AuditItem]) -> bool:
        """Ship `items` as one frame. False if the writer had exited before taking it: the items
        are back at the head of the queue, for the background thread (which starts a new writer).
        Never raises: a frame that cannot be written at all is counted as dropped, with the reason."""
        columns = to_columns(items)
        try:
            try:
                shipped = self.process.ship(columns, len(items))
            except ValueError:  # a value marshal refuses, e.g. a StrEnum audience: send plain values
                shipped = self.process.ship(plain_columns(columns), len(items))
        except Exception as exc:  # never into a caller's seal or unseal
            self.queue.drop(len(items), f"cannot ship them to the writer: {type(exc).__name__}: {exc}")
            shipped = True
        if not shipped:
            self.queue.requeue(items)
            self.queue.paused = True
            self._wake()
            return False
        self.queue.release(items, tokens_cost(columns[3]))
        return True

    def ship_inline(self) -> None:
        """Ship from the submitting thread: frames while `SHIP_AT` items are queued (at least one);
        never waits: if another thread is shipping, the pipe is full or no writer process runs
        (the background thread starts one), returns at once."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            q, process = self.queue, self.process
            while True:
                if process.backlogged or process.pid is None:
                    q.paused = True  # until the background thread, which waits on the pipe or starts a writer, is done
                    self._wake()
                    return
                items = q.take_settled(FRAME, keep=KEEP)
                if not items or not self._send(items):
                    return
                self.inline += 1
                if len(q.items) < q.ship_at:
                    return
        finally:
            self._lock.release()

    def ship_all(self, timeout: float, *, final: bool = False) -> bool:
        """Ship what is queued (`final`: everything; else what is at least `SETTLE` s old), waiting
        up to `timeout` seconds in all while the pipe is full. True if nothing was left behind."""
        deadline = time.monotonic() + timeout
        before = float("inf") if final else time.time() - SETTLE
        with self._lock:
            q, process = self.queue, self.process
            try:
                while True:
                    if process.backlogged:
                        left = deadline - time.monotonic()
                        if left <= 0 or not process.drain(min(left, DRAIN_SLICE)):
                            if time.monotonic() >= deadline:
                                return False
                            continue
                    items = q.take_settled(FRAME, before=before)
                    if not items:
                        if final:
                            process.sync()
                            process.drain(max(0.0, deadline - time.monotonic()))
                        return not process.backlogged and not q.items
                    if not self._send(items):
                        return False  # the writer exited: the next wake-up starts a new one
            finally:
                q.paused = process.backlogged  # submitting threads ship again once the pipe takes frames

    def next_wait(self, found: int) -> float:
        """The background thread's next sleep (seconds), given that it `found` items to ship on
        this wake-up: `interval` while nobody else ships them, doubling up to `MAX_WAIT` while
        the submitting threads do (or nothing is queued), 0 while the pipe holds a backlog."""
        inline, self._inline_seen = self.inline != self._inline_seen, self.inline
        if self.process.backlogged:
            self._wait = self.interval
            return 0.0
        if found and not inline:
            self._wait = self.interval
        else:
            self._wait = min(self._wait * 2, MAX_WAIT)
        return self._wait

    @property
    def backlogged(self) -> bool:
        return self.process.backlogged
