"""Per-process seal, unseal and rejection counts per kid: what every token core counts on its hot path.

Every core of a ring (each audience's codec, each reload, the sidecar's and the library's alike) counts into
the one `RingUsage` of that ring in this process (`usage_for`, by ``ring_id``), per kid in a `KidTally`:
``seals``, ``unseals`` and ``rejections``. A token costs one C call (``next()`` on an `itertools.count`,
atomic under the GIL: no lock, no remote call; on an interpreter without a GIL, a counter under a lock) and,
after a seal, one comparison with ``mark``. Rejections of a token whose kid the ring does not hold count on
the ring's ``unknown`` tally, so a forged kid never grows anything.

The fleet-wide totals live in the presence store (`mrtr_keys.fleet.usage`): its reporter reads these counters
in the background and reserves seals ahead; ``mark`` is the seal count at which it wants to be woken (its
reservation is running low), so a burst never waits for its next round. `over_budget` holds the kids whose
fleet-wide seals passed their budget: their seals carry an audit reason (`OVER_BUDGET`).

``MRTR_KEYS_SEAL_COUNTS=off`` (`ENV_SEAL_COUNTS`, read when a ring is first counted) turns counting off, to
measure what it costs (``make bench``, part ``sidecar_load``): every tally is then inert and nothing is reported,
so no budget is watched anywhere. Never in production.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable, Iterator

UNKNOWN = "unknown"
"""The tally of rejected tokens whose kid is not in the ring (or that carry none): one label, whatever is forged."""
OVER_BUDGET = "over-budget"
"""Audit reason of a seal by a key whose fleet-wide seals passed its budget (sealing never stops)."""
NEVER = 2**62
"""A ``mark`` no count reaches: nobody to wake."""
ENV_SEAL_COUNTS = "MRTR_KEYS_SEAL_COUNTS"
"""``off`` turns counting off (see the module docstring)."""

over_budget: set[str] = set()
"""Kids (8 hex) whose fleet-wide seal count has passed their budget, as this process's reporter last read it."""

_NO_GIL = not getattr(sys, "_is_gil_enabled", lambda: True)()


class _LockedCount:
    """`itertools.count` for an interpreter without a GIL: the same ``next()`` and ``repr()``, under a lock."""

    __slots__ = ("_lock", "_n")

    def __init__(self, start: int) -> None:
        self._lock = threading.Lock()
        self._n = start

    def __next__(self) -> int:
        with self._lock:
            n = self._n
            self._n = n + 1
            return n

    def __repr__(self) -> str:
        return f"count({self._n})"


def _counter() -> itertools.count[int] | _LockedCount:
    """A counter whose ``next()`` returns the running total (1 for the first event)."""
    return _LockedCount(1) if _NO_GIL else itertools.count(1)


def _value(counter: itertools.count[int] | _LockedCount) -> int:
    """How many times ``next()`` was called: its repr is ``count(N)``, N the next value (read without counting)."""
    return int(repr(counter)[6:-1]) - 1


class KidTally:
    """The counts of one kid in this process (see the module docstring).

    ``seal``, ``unseal`` and ``reject`` are the bound ``next`` of each counter (what the cores call);
    `seals`, `unseals` and `rejections` read them without counting.
    """

    __slots__ = ("_rejections", "_ring_wake", "_seals", "_unseals", "kid", "mark", "reject", "seal", "unseal")

    def __init__(self, kid: str, wake: Callable[[], None]) -> None:
        self.kid = kid
        self._seals, self._unseals, self._rejections = _counter(), _counter(), _counter()
        self.seal = self._seals.__next__
        self.unseal = self._unseals.__next__
        self.reject = self._rejections.__next__
        self.mark = NEVER
        """The seal count (as ``seal()`` returns it) at which the core calls `wake`."""
        self._ring_wake = wake

    def __repr__(self) -> str:
        return f"KidTally({self.kid}, seals={self.seals}, unseals={self.unseals}, rejections={self.rejections})"

    def wake(self) -> None:
        """A seal reached ``mark``: wake the reporter once (``mark`` is unset until it reserves again)."""
        self.mark = NEVER
        self._ring_wake()

    @property
    def seals(self) -> int:
        return _value(self._seals)

    @property
    def unseals(self) -> int:
        return _value(self._unseals)

    @property
    def rejections(self) -> int:
        return _value(self._rejections)


class RingUsage:
    """The tallies of one ring in this process, by kid (made on first use, never removed)."""

    def __init__(self, ring_id: str) -> None:
        self.ring_id = ring_id
        self._lock = threading.Lock()
        self._kids: dict[str, KidTally] = {}
        self._listeners: list[Callable[[], None]] = []
        self.unknown = KidTally(UNKNOWN, self.wake)

    def __repr__(self) -> str:
        return f"RingUsage({self.ring_id!r}, kids=[{', '.join(self._kids)}])"

    def kid(self, kid: str) -> KidTally:
        """The tally of `kid` (a kid of the ring; cores make them for their keys, never for a token's kid)."""
        tally = self._kids.get(kid)
        if tally is None:
            with self._lock:
                tally = self._kids.setdefault(kid, KidTally(kid, self.wake))
        return tally

    def tallies(self) -> Iterator[KidTally]:
        """Every kid's tally, then `unknown`."""
        yield from list(self._kids.values())
        yield self.unknown

    def listen(self, wake: Callable[[], None]) -> None:
        """Call `wake` whenever a seal reaches a tally's ``mark`` (the reporter's event; must not block)."""
        with self._lock:
            self._listeners.append(wake)

    def unlisten(self, wake: Callable[[], None]) -> None:
        with self._lock:
            if wake in self._listeners:
                self._listeners.remove(wake)

    def wake(self) -> None:
        for listener in list(self._listeners):
            listener()


class _Inert(KidTally):
    """A tally that counts nothing (counting off): every call returns 0."""

    __slots__ = ()

    def __init__(self, kid: str) -> None:
        super().__init__(kid, lambda: None)
        self.seal = self.unseal = self.reject = int  # a C call that returns 0 and keeps nothing


class _InertUsage(RingUsage):
    def __init__(self) -> None:
        super().__init__("")
        self.unknown = _Inert(UNKNOWN)

    def kid(self, kid: str) -> KidTally:
        return self.unknown


_rings: dict[str, RingUsage] = {}
_rings_lock = threading.Lock()
_OFF = _InertUsage()


def enabled() -> bool:
    """False when ``MRTR_KEYS_SEAL_COUNTS=off`` (`ENV_SEAL_COUNTS`)."""
    return os.environ.get(ENV_SEAL_COUNTS, "").strip().lower() != "off"


def usage_for(ring_id: str) -> RingUsage:
    """This process's `RingUsage` of ring `ring_id` (made on first use; an inert one with counting off)."""
    usage = _rings.get(ring_id)
    if usage is None:
        if not enabled():
            return _OFF
        with _rings_lock:
            usage = _rings.setdefault(ring_id, RingUsage(ring_id))
    return usage


def rings() -> list[RingUsage]:
    """Every ring this process has counted for."""
    return list(_rings.values())
