"""`AuditQueue`: the audit sink's queue, bounded in events and in bytes, with backpressure.

Every item is charged `mrtr_keys.audit.capture.items.item_bytes` from `submit` until the sink `release`s
it (handed to the writer process, or stored). Below the high-water mark (half of `capacity` and
half of `max_bytes`) `submit` takes one short lock and appends; when `ship_at` items are queued, or
the oldest has waited `ship_delay` seconds, it then calls `on_ready` (the process-mode sink ships a
frame from the calling thread, so no background thread has to wake and compete for the
interpreter lock while the process is busy). Above it, while the writer is
healthy, the caller waits (at most `max_wait` seconds) for it to catch up: callers are slowed,
not dropped. An event is dropped only when waiting did not help (the writer stalled, or the store
cannot be written) and the queue is at its hard bound; `dropped` counts every such event and a
WARNING on ``mrtr_keys.audit`` says how many so far, at most once a second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat, starmap

from mrtr_keys.audit.capture.items import ITEM_OVERHEAD_BYTES, AuditItem
from mrtr_keys.token import MAX_TOKEN_CHARS

logger = logging.getLogger("mrtr_keys.audit")

DEFAULT_CAPACITY = 50_000
"""Events the queue holds at most (its hard bound; the high-water mark is half of it)."""
DEFAULT_MAX_BYTES = 16 << 20
"""Bytes the queue holds at most (`item_bytes` summed; the high-water mark is half of it)."""
DEFAULT_MAX_WAIT = 2.0
"""Seconds a caller waits at the high-water mark for a working writer before dropping is allowed."""
TOKEN_KEEP = MAX_TOKEN_CHARS + 1
"""Characters of a token kept for its fingerprint: anything longer is not a token any codec
accepts, and its fingerprint (``raw:`` + the first `MAX_TOKEN_CHARS`) is the same when cut here."""
DROP_LOG_INTERVAL = 1.0
RETRACT_SCAN = 4_096
"""Newest queued items searched for the target of a `replace` (a retraction follows its unseal
within microseconds, so it is among the last few)."""


def tokens_cost(tokens: Sequence[str | None]) -> int:
    """The memory charged for items with these `tokens` (bytes; `mrtr_keys.audit.capture.items.item_bytes`
    summed)."""
    return ITEM_OVERHEAD_BYTES * len(tokens) + sum(map(len, filter(None, tokens)))


def _cost(items: Sequence[AuditItem]) -> int:
    return tokens_cost([x[3] for x in items])


class AuditQueue:
    """The bounded queue (see the module docstring).

    Args:
        capacity: hard bound in events; `max_bytes`: hard bound in bytes; `max_wait`: seconds a
            caller may be slowed at the high-water mark.
        healthy: True while the writer can store (callers wait only then).
        wake: asks the writer to run now. `where`: names the store in log lines.
        on_ready: called (outside the lock, by the submitting thread) once `ship_at` items are
            queued or the oldest has waited `ship_delay` seconds; None: never.
    """

    def __init__(
        self,
        *,
        capacity: int = DEFAULT_CAPACITY,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_wait: float = DEFAULT_MAX_WAIT,
        healthy: Callable[[], bool],
        wake: Callable[[], None],
        where: str,
        on_ready: Callable[[], None] | None = None,
        ship_at: int = 512,
        ship_delay: float = 0.05,
    ) -> None:
        if capacity < 2 or max_bytes < 2 * (ITEM_OVERHEAD_BYTES + TOKEN_KEEP) or not max_wait >= 0:
            raise ValueError("capacity >= 2, max_bytes >= two largest items, max_wait >= 0")
        self.capacity, self.max_bytes, self.max_wait = capacity, max_bytes, max_wait
        self.high_water, self.high_bytes = capacity // 2, max_bytes // 2
        self._healthy, self._wake, self._where = healthy, wake, where
        self.on_ready = on_ready
        self.ship_at, self.ship_delay, self.ship_keep = ship_at, ship_delay, 0
        self.paused = False
        """True while `on_ready` would find nothing to do (the writer's pipe is full): not called."""
        self.on_first: Callable[[], None] | None = None
        """Called (outside the lock) when an item lands in an empty queue and `on_ready` is not:
        the process-mode sink wakes its background thread, which may be in a long sleep."""
        self.items: deque[AuditItem] = deque()
        self.n = 0
        """Events charged: queued, or being handed to the writer."""
        self.bytes = 0
        self.high = 0
        """Most events charged at once."""
        self.dropped = 0
        self.slowed = 0
        """Callers made to wait at the high-water mark."""
        self.writer_thread: threading.Thread | None = None
        """The writer's own thread (never made to wait)."""
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        """`_lock` guards the counts; `submit`'s fast path takes it directly (a C call), the rest
        through this condition."""
        self._waiters = 0
        self._stalled = False
        self._drop_lock = threading.Lock()
        self._last_drop_log = 0.0

    @property
    def congested(self) -> bool:
        """True while past the high-water mark (strict callers refuse then)."""
        return self.n >= self.high_water or self.bytes >= self.high_bytes

    def submit(self, item: AuditItem) -> None:
        """Queue one item; waits at the high-water mark (see the module docstring); never raises."""
        token = item.token
        if token is not None and len(token) > TOKEN_KEEP:
            item = item._replace(token=token[:TOKEN_KEEP])
            token = item.token
        cost = ITEM_OVERHEAD_BYTES + (len(token) if token is not None else 0)
        with self._lock:
            if self.n < self.high_water and self.bytes + cost <= self.high_bytes:
                items = self.items
                items.append(item)
                self.n += 1
                self.bytes += cost
                k = len(items)
                ready = k >= self.ship_at or (k > self.ship_keep and item.time - items[0].time >= self.ship_delay)
            else:
                ready = None
        if ready is None:
            self._submit_congested(item, cost)
        elif ready and self.on_ready is not None and not self.paused:
            self.on_ready()
        elif k == 1 and self.on_first is not None:
            self.on_first()

    def submit_many(self, items: list[AuditItem]) -> None:
        """Queue `items` in order (a batch request's events) under one lock; past the high-water
        mark, or with a token over the cap, item by item as `submit` does. Never raises."""
        tokens = [x[3] for x in items]
        lengths = list(map(len, filter(None, tokens)))
        if not items or max(lengths, default=0) > TOKEN_KEEP:
            for item in items:
                self.submit(item)
            return
        cost = tokens_cost(tokens)
        with self._lock:
            if self.n + len(items) <= self.high_water and self.bytes + cost <= self.high_bytes:
                queue = self.items
                queue.extend(items)
                self.n += len(items)
                self.bytes += cost
                k = len(queue)
                ready = k >= self.ship_at or (k > self.ship_keep and items[-1].time - queue[0].time >= self.ship_delay)
            else:
                ready = None
        if ready is None:
            for item in items:
                self.submit(item)
        elif ready and self.on_ready is not None and not self.paused:
            self.on_ready()
        elif k == len(items) and self.on_first is not None:
            self.on_first()

    def _submit_congested(self, item: AuditItem, cost: int) -> None:
        deadline = 0.0
        with self._space:
            while self.n >= self.high_water or self.bytes + cost > self.high_bytes:
                if self._stalled or not self._healthy() or threading.current_thread() is self.writer_thread:
                    break
                now = time.monotonic()
                if not deadline:
                    deadline = now + self.max_wait
                    self.slowed += 1
                elif now >= deadline:
                    self._stalled = True  # waiting did not help: drop at the hard bound until it drains
                    break
                self._waiters += 1
                self._wake()
                try:
                    self._space.wait(deadline - now)
                finally:
                    self._waiters -= 1
            if self.n < self.capacity and self.bytes + cost <= self.max_bytes:
                self.items.append(item)
                self.n += 1
                self.bytes += cost
                self.high = max(self.high, self.n)
                return
        self.drop()

    def take(self, n: int) -> list[AuditItem]:
        """Pop the `n` oldest items (still charged until `release`)."""
        with self._lock:
            return list(starmap(self.items.popleft, repeat((), min(n, len(self.items)))))

    def take_settled(self, n: int, *, keep: int = 0, before: float = float("inf")) -> list[AuditItem]:
        """Pop up to `n` of the oldest items, leaving the newest `keep` and every item from
        `before` on (POSIX time) queued, so that a `replace` right after a submit finds its item."""
        items = self.items
        with self._lock:  # against `replace`, which walks the deque
            k = min(n, len(items) - keep)
            if k <= 0:
                return []
            if items[k - 1].time >= before:
                k = next((i for i, x in enumerate(items) if i >= k or x.time >= before), k)
            return list(starmap(items.popleft, repeat((), k)))

    def requeue(self, items: list[AuditItem]) -> None:
        """Put taken `items` back at the head of the queue, in order (still charged; the writer
        they were for exited before reading them)."""
        with self._lock:
            self.items.extendleft(reversed(items))

    def replace(self, old: AuditItem, new: AuditItem) -> bool:
        """Put `new` in the place of queued `old` (the same object; searched among the newest
        `RETRACT_SCAN`). False if `old` is no longer queued (taken by the writer)."""
        with self._space:
            for back, x in enumerate(reversed(self.items)):
                if x is old:
                    self.items[-back - 1] = new
                    self.bytes += _cost((new,)) - _cost((old,))
                    return True
                if back >= RETRACT_SCAN:
                    break
        return False

    def release(self, items: Sequence[AuditItem], cost: int | None = None) -> None:
        """`items` left this process's memory (shipped or written): uncharge them (`cost`: their
        `tokens_cost`, if the caller has it); wake waiters."""
        if not items:
            return
        if cost is None:
            cost = _cost(items)
        with self._space:
            self.n -= len(items)
            self.bytes -= cost
            if self.n < self.high_water and self.bytes < self.high_bytes:
                self._stalled = False
                if self._waiters:
                    self._space.notify_all()

    def wake_all(self) -> None:
        """Let every waiting caller go (the sink is closing)."""
        with self._space:
            self._stalled = True
            self._space.notify_all()

    def drop(self, n: int = 1, why: str | None = None) -> None:
        """Count `n` events that will never be stored; log (at most once a second, or with `why`)."""
        with self._drop_lock:
            self.dropped += n
            now = time.monotonic()
            if why is not None:
                logger.warning("audit: %d events dropped: %s (store %s)", n, why, self._where)
            elif now - self._last_drop_log >= DROP_LOG_INTERVAL or self.dropped == n:
                self._last_drop_log = now
                logger.warning(
                    "audit queue full (%d events, %d bytes): %d events dropped so far (store %s)",
                    self.n,
                    self.bytes,
                    self.dropped,
                    self._where,
                )
