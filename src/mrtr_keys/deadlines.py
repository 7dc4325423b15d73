"""Client-side deadlines for blocking socket calls whose library has none (psycopg's reads and writes).

A database that goes silent (connections held open, nothing answered: a dropped route, a hung
server, a blackholing firewall) never makes a blocking client fail by itself: libpq has a connect
timeout but no read or write timeout, and TCP keepalives do not help when the peer's kernel still
acknowledges. ``statement_timeout`` is enforced by the server, so it cannot end a call the server
never sees. `Watchdog.guard` bounds a call from the client side instead: if the block is still
running at its deadline, one watchdog thread shuts the connection's socket down
(``shutdown(SHUT_RDWR)`` on a duplicate of its descriptor), so the blocked read or write returns at
once and the library raises its usual "connection lost" error; the caller drops that connection
and the next call opens a new one.

One thread serves every guard in the process (started on first use); a guard costs a heap push
and a lock, no thread and no system call unless its deadline passes.
"""

from __future__ import annotations

import heapq
import itertools
import os
import socket
import threading
import time


class Guard:
    """One guarded call (a context manager; `fired` is True once its deadline cut the socket)."""

    __slots__ = ("active", "deadline", "fd", "fired", "seconds", "watchdog")

    def __init__(self, watchdog: Watchdog, fd: int, seconds: float) -> None:
        self.watchdog, self.fd, self.seconds = watchdog, fd, seconds
        """The deadline, in seconds from the block's start."""
        self.deadline = 0.0
        """The deadline on `time.monotonic`'s clock (set when the block starts)."""
        self.active = True
        self.fired = False

    def __enter__(self) -> Guard:
        self.deadline = time.monotonic() + self.seconds
        self.watchdog._add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with self.watchdog._cond:  # so the watchdog cannot cut `fd` once the block has ended
            self.active = False


class Watchdog:
    """Shuts down the socket of a guarded call that overran its deadline (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Guard]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.fired = 0
        """Guarded calls cut at their deadline so far."""

    def guard(self, fd: int, seconds: float) -> Guard:
        """A context manager: the socket `fd` is shut down if the block is still running after
        `seconds`. Its ``fired`` is then True (the caller may say "timed out" rather than "connection
        lost")."""
        return Guard(self, fd, seconds)

    def _add(self, guard: Guard) -> None:
        with self._cond:
            heap = self._heap
            heapq.heappush(heap, (guard.deadline, next(self._ids), guard))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mrtr-keys-deadlines", daemon=True)
                self._thread.start()
            elif heap[0][2] is guard:
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and not self._heap[0][2].active:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                _, _, guard = heapq.heappop(self._heap)
                guard.fired = True
                self.fired += 1
                _shutdown(guard.fd)  # under the lock: the guarded block cannot end (and free fd) meanwhile


def _shutdown(fd: int) -> None:
    try:
        dup = os.dup(fd)
    except OSError:
        return
    try:
        with socket.socket(fileno=dup) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


WATCHDOG = Watchdog()
"""The process's one watchdog (`Watchdog.guard`)."""
