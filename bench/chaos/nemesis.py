"""The nemesis: plays a `Schedule` on the fleet, each fault in its own thread, and keeps the timeline.

A fault is applied at its time (from the run's start), held for its duration and healed; `Timeline` keeps
what really happened (`Applied`: the POSIX times it began and ended, and a note: the writer pid killed, the
ring race's exit codes, why it could not be applied), for the checker to name the faults active at any
moment. A kill ends when the instance serves again; `heal_all` ends every fault at once (the last heal).
The nemesis knows nothing of the invariants: it only acts and records.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos import fleet
from bench.chaos.fleet import Links, Member
from bench.chaos.schedule import RING_KINDS, Fault, Schedule


@dataclass
class Applied:
    """A fault as it happened."""

    fault: Fault
    began: float
    ended: float | None = None
    note: str = ""

    def active(self, at: float, slack: float = 0.0) -> bool:
        end = time.time() if self.ended is None else self.ended
        return self.began - slack <= at <= end + slack

    def overlaps(self, start: float, end: float, slack: float = 0.0) -> bool:
        mine = time.time() if self.ended is None else self.ended
        return self.began - slack <= end and start <= mine + slack

    def to_dict(self) -> dict[str, Any]:
        return {**self.fault.to_dict(), "began": round(self.began, 3), "ended": self.ended, "note": self.note}


@dataclass
class Timeline:
    applied: list[Applied] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, a: Applied) -> Applied:
        with self.lock:
            self.applied.append(a)
        return a

    def during(self, start: float, end: float, slack: float = 0.0) -> list[Applied]:
        with self.lock:
            return [a for a in self.applied if a.overlaps(start, end, slack)]

    def labels(self, start: float, end: float | None = None, slack: float = 0.0) -> list[str]:
        """The faults active at some moment of [start, end], one label each (for a violation's message)."""
        return [a.fault.label().strip() for a in self.during(start, end or start, slack)]

    def last_end(self) -> float:
        with self.lock:
            return max((a.ended or time.time() for a in self.applied), default=0.0)


class Nemesis:
    """Plays `schedule` on `members` / `links` / the state directory (see the module docstring).

    Args:
        ring: runs a fault on the key ring itself (`bench.chaos.ring_faults`); returns its note.
        disk_full: False where the state directory is not a file system of its own (the fault is then
            recorded as not applied).
        anchors: the instances' anchor destination (``anchor_fail`` puts a file in its place).
    """

    def __init__(
        self,
        schedule: Schedule,
        members: dict[str, Member],
        links: Links,
        state: Path,
        *,
        ring: Callable[[Fault], str],
        disk_full: bool,
        anchors: Path | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.schedule = schedule
        self.members = members
        self.links = links
        self.state = state
        self.ring = ring
        self.disk_full = disk_full
        self.anchors = anchors
        self.log = log
        self.timeline = Timeline()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._main: threading.Thread | None = None
        self.errors: list[str] = []

    def start(self, t0: float) -> None:
        """Play the schedule with its time 0 at `t0` (a POSIX time)."""
        self._main = threading.Thread(target=self._play, args=(t0,), name="nemesis", daemon=True)
        self._main.start()

    def _play(self, t0: float) -> None:
        for fault in self.schedule.faults:
            if self._stop.wait(max(0.0, t0 + fault.at - time.time())):
                return
            thread = threading.Thread(target=self._one, args=(fault,), name=f"nemesis-{fault.kind}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def stop(self) -> None:
        """Apply no new fault, end the ones in progress now (their threads heal as they return)."""
        self._stop.set()
        if self._main is not None:
            self._main.join(10)
        for t in self._threads:
            t.join(120)

    def _hold(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def _one(self, fault: Fault) -> None:
        a = self.timeline.add(Applied(fault, time.time()))
        self.log(f"[chaos] fault {fault.label().strip()}")
        try:
            self._apply(fault, a)
        except Exception as exc:
            a.note = (a.note + f"; error: {type(exc).__name__}: {exc}").strip("; ")[:500]
            self.errors.append(f"{fault.label().strip()}: {type(exc).__name__}: {exc}"[:500])
        finally:
            if a.ended is None:
                a.ended = time.time()

    def _apply(self, fault: Fault, a: Applied) -> None:
        kind = fault.kind
        if kind == "kill":
            member = self.members[fault.target]
            fleet.kill(member)
            self._hold(fault.duration)
            failed = fleet.supervise(member)
            a.note = f"pid {member.pid}" + (f" after {failed} failed start(s)" if failed else "")
        elif kind == "pause":
            member = self.members[fault.target]
            if not fleet.pause(member):
                a.note = "not running: not paused"
                return
            self._hold(fault.duration)
            fleet.resume(member)
        elif kind == "writer_kill":
            pid = fleet.writer_pid(self.members[fault.target])
            if pid is None:
                a.note = "no writer process"
                return
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            a.note = f"writer pid {pid}"
        elif kind == "disk_full":
            if not self.disk_full:
                a.note = "not applied: the state directory is not a file system of its own"
                return
            a.note = f"{fleet.fill_disk(self.state)} bytes written"
            self._hold(fault.duration)
            fleet.free_disk(self.state)
        elif kind == "anchor_fail":
            if self.anchors is None:
                a.note = "not applied: no anchor destination"
                return
            fleet.break_anchors(self.anchors)
            self._hold(fault.duration)
            fleet.mend_anchors(self.anchors)
        elif kind in RING_KINDS:
            a.note = self.ring(fault)
        else:
            self._link(fault)

    def _link(self, fault: Fault) -> None:
        assert fault.dependency is not None
        proxies = self.links.of(fault.dependency, fault.target)
        for p in proxies:
            if fault.kind == "cut":
                p.stop()
            elif fault.kind == "blackhole":
                p.faults.blackhole()
            elif fault.kind == "slow":
                p.faults.latency(fault.latency or 0.0)
            elif fault.kind == "flap":
                p.faults.flap(1_000_000, down=fault.down or 0.5, up=fault.up or 0.5)
        try:
            self._hold(fault.duration)
        finally:
            for p in proxies:
                if fault.kind == "flap":
                    p.faults.stop_flapping()
                p.faults.restore()
                p.start()

    def heal_all(self) -> float:
        """The last heal: stop the schedule, resume, restart, restore every link and free the disk; its time."""
        self.stop()
        self.links.heal()
        fleet.free_disk(self.state)
        if self.anchors is not None:
            fleet.mend_anchors(self.anchors)
        for member in self.members.values():
            fleet.resume(member)
            if member.killed:
                fleet.supervise(member)
        return time.time()
