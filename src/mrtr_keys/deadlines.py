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
from collections.abc import Iterator
from contextlib import contextmanager


class _Entry:
    __slots__ = ("active", "fd", "fired")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.active = True
        self.fired = False


class Watchdog:
    """Shuts down the socket of a guarded call that overran its deadline (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Entry]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.fired = 0
        """Guarded calls cut at their deadline so far."""

    @contextmanager
    def guard(self, fd: int, seconds: float) -> Iterator[_Entry]:
        """Run the block with the socket `fd` shut down if it is still running after `seconds`.

        The entry yielded has ``fired`` True once the deadline cut the socket (the caller may then
        say "timed out" rather than "connection lost").
        """
        entry = _Entry(fd)
        deadline = time.monotonic() + seconds
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._ids), entry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mrtr-keys-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is entry:
                self._cond.notify()
        try:
            yield entry
        finally:
            with self._cond:
                entry.active = False

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
                _, _, entry = heapq.heappop(self._heap)
                entry.fired = True
                self.fired += 1
                _shutdown(entry.fd)  # under the lock: the guarded block cannot end (and free fd) meanwhile


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
