"""Which live instances have applied a ring generation, and waiting until all have (``keys revoke --wait``).

Each instance's presence row (`mrtr_keys.fleet.presence`) says the generation it loaded, written at once
when it loads one. An instance has applied generation N once its row reports N or later and its ring
watcher is not stuck. The ones that have not are named with their note, which says why one of them cannot
learn of the change by itself: ``reload off`` (it reads the ring only at start, on SIGHUP or on an unknown
kid), ``fenced out`` or ``keystore: ...`` (it cannot reach the keystore and serves its last good ring),
``watcher stuck since ...``. Waiting polls the rows; clocks are injected so tests never sleep.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from mrtr_keys.audit.writing.stores.base import AuditStore
from mrtr_keys.fleet.gates import live_instances
from mrtr_keys.fleet.instances import InstanceRecord
from mrtr_keys.ring.model import KeyRing, utcnow

DEFAULT_POLL = 0.25
"""Seconds between two reads of the presence rows while waiting."""


@dataclass(frozen=True)
class Applied:
    """At one moment: the live instances of a ring, and those that have not applied `target` yet."""

    target: int
    live: list[InstanceRecord] = field(default_factory=list)
    lagging: list[InstanceRecord] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return not self.lagging

    def describe(self, now: float) -> str:
        """``3 of 4 live instance(s) applied generation 7; not yet: web-2 (generation 6, reload off)``."""
        ready = len(self.live) - len(self.lagging)
        head = f"{ready} of {len(self.live)} live instance(s) applied generation {self.target}"
        if not self.lagging:
            return head
        return head + "; not yet: " + "; ".join(_lag(r, now) for r in self.lagging)

    def to_json(self, now: float) -> dict[str, Any]:
        return {
            "generation": self.target,
            "live": len(self.live),
            "applied": len(self.live) - len(self.lagging),
            "lagging": [
                {"name": r.name, "generation": r.generation, "note": r.note, "age_seconds": round(r.age(now), 3)}
                for r in self.lagging
            ],
        }


def applied(store: AuditStore, ring: KeyRing, target: int, now: datetime | None = None) -> Applied:
    """Which live instances of `ring` have applied generation `target` at `now` (see the module docstring).

    Raises:
        AuditError: the store cannot be read.
    """
    live = live_instances(store, ring, now or utcnow())
    lagging = [r for r in live if r.generation is None or r.generation < target or r.watcher_stuck]
    return Applied(target, live, lagging)


def wait_applied(
    store: AuditStore,
    ring: KeyRing,
    target: int,
    *,
    wait: float,
    on_wait: Callable[[Applied], None] | None = None,
    poll: float = DEFAULT_POLL,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Applied:
    """Poll `applied` until every live instance has applied `target` or `wait` seconds have passed; returns
    the last answer (`Applied.done` says which). `on_wait` is told each answer that is not done yet.

    Raises:
        AuditError: the store cannot be read.
    """
    deadline = clock() + wait
    while True:
        state = applied(store, ring, target)
        left = deadline - clock()
        if state.done or left <= 0:
            return state
        if on_wait is not None:
            on_wait(state)
        sleep(min(poll, left))


def _lag(r: InstanceRecord, now: float) -> str:
    gen = "-" if r.generation is None else str(r.generation)
    note = f", {r.note}" if r.note else ""
    return f"{r.name} (generation {gen}, heartbeat {math.floor(r.age(now))} s ago{note})"
