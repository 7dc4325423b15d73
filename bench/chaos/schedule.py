"""The nemesis's schedule: which fault, when, on what, for how long, drawn from one seed and saved as JSON.

`make_schedule(seed, seconds, instances)` draws faults as a Poisson process (`rate` a minute on average)
from the menu (`KINDS`, each with a weight), each with its target and duration:

| kind | target | duration | what the nemesis does |
|---|---|---|---|
| ``kill`` | an instance | 0.5-5 s down | SIGKILL, then the same command again (same port) |
| ``pause`` | an instance | 0.1-30 s (log-uniform) | SIGSTOP, then SIGCONT |
| ``cut`` | a dependency of one instance, or of ``all`` | 1-30 s | its proxy refuses and cuts connections |
| ``blackhole`` | as ``cut`` | 1-30 s | its proxy holds connections and answers nothing |
| ``slow`` | as ``cut`` | 1-30 s | every chunk waits `latency` (0.05-2 s, log-uniform) |
| ``flap`` | as ``cut`` | 5-30 s | cut for `down` s, back for `up` s, over and over |
| ``writer_kill`` | an instance | instant | SIGKILL of its audit writer process |
| ``disk_full`` | ``state`` | 5-60 s | the fleet's state directory (a small tmpfs) filled to the last byte |
| ``ring_race`` | ``ring`` | instant | ``rotate next`` and ``audience add`` started at once, racing the rotator |
| ``revoke`` | ``ring`` | instant | ``keys revoke`` of the primary or the verify key (issue 37) |
| ``budget`` | ``ring`` | instant | primary's budget lowered, ``rotate next --if-used-over 0.5`` (issue 36) |
| ``anchor_fail`` | ``anchors`` | 5-60 s | the anchor directory replaced by a file: every anchor fails (issue 38) |

A dependency is ``keystore`` (OpenBao KV v2), ``audit`` (PostgreSQL: presence and the audit log) or
``replay`` (Redis: single-use rounds); ``all`` is that dependency for every instance and the rotator.

Faults overlap, within two limits that keep the run a test of the system rather than of an empty fleet: at
most half the instances (at least one) are killed or paused at any moment, and one proxy plays one fault at a
time (a ``slow`` and a ``blackhole`` on the same link would end each other: the proxy has one fault state).
A fault that would break either limit goes to another target, or is not drawn. Every fault ends before the
run's quiet tail. The same seed, length, fleet, rate and menu give the same schedule; `Schedule.to_json` /
`from_json` save it and read it back for ``--replay``.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEPENDENCIES = ("keystore", "audit", "replay")
LINK_KINDS = ("cut", "blackhole", "slow", "flap")
PROCESS_KINDS = ("kill", "pause")
WEIGHTS: dict[str, float] = {
    "kill": 1.0,
    "pause": 1.5,
    "cut": 1.2,
    "blackhole": 1.2,
    "slow": 1.2,
    "flap": 0.8,
    "writer_kill": 0.6,
    "disk_full": 0.4,
    "ring_race": 0.6,
    "revoke": 0.4,
    "budget": 0.4,
    "anchor_fail": 0.4,
}
"""Relative frequency of each kind in the menu."""
KINDS = tuple(WEIGHTS)
ALL = "all"
"""The target of a dependency fault on every instance's link (and the rotator's)."""
RING_KINDS = ("ring_race", "revoke", "budget")
"""Faults on the key ring itself (`bench.chaos.ring_faults`), all at once."""
INSTANT = ("writer_kill", *RING_KINDS)
WHOLE = {"disk_full": "state", "anchor_fail": "anchors"}
"""Faults on something the whole fleet shares, one at a time, 5-60 s: kind -> target."""


@dataclass(frozen=True)
class Fault:
    """One scheduled fault. Times in seconds from the start of the run."""

    at: float
    kind: str
    target: str
    duration: float = 0.0
    dependency: str | None = None
    latency: float | None = None
    """``slow``: seconds each chunk waits, each way."""
    down: float | None = None
    """``flap``: seconds cut in each cycle."""
    up: float | None = None
    """``flap``: seconds back in each cycle."""

    @property
    def end(self) -> float:
        return self.at + self.duration

    def label(self) -> str:
        """One line: ``12.3 s pause mcp-2 for 4.5 s``, ``40.0 s slow audit/all 0.8 s for 12 s``."""
        what = f"{self.dependency}/{self.target}" if self.dependency else self.target
        extra = f" {self.latency:.2g} s" if self.latency is not None else ""
        if self.down is not None:
            extra = f" {self.down:.2g}s down/{self.up:.2g}s up"
        span = f" for {self.duration:.3g} s" if self.duration else ""
        return f"{self.at:7.1f} s {self.kind} {what}{extra}{span}"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Schedule:
    """A whole run's faults and what drew them."""

    seed: int
    seconds: float
    instances: tuple[str, ...]
    rate: float
    """Faults a minute on average."""
    faults: tuple[Fault, ...] = field(default_factory=tuple)
    menu: tuple[str, ...] = KINDS

    def counts(self) -> dict[str, int]:
        """kind -> how many faults of it."""
        out: dict[str, int] = {}
        for f in self.faults:
            out[f.kind] = out.get(f.kind, 0) + 1
        return dict(sorted(out.items()))

    def to_json(self) -> str:
        doc = {
            "seed": self.seed,
            "seconds": self.seconds,
            "instances": list(self.instances),
            "rate": self.rate,
            "menu": list(self.menu),
            "faults": [f.to_dict() for f in self.faults],
        }
        return json.dumps(doc, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """A saved schedule (``--replay``).

        Raises:
            ValueError: not a schedule this module wrote (the message says what is wrong).
        """
        try:
            doc = json.loads(text)
            faults = tuple(Fault(**f) for f in doc["faults"])
            return cls(
                seed=int(doc["seed"]),
                seconds=float(doc["seconds"]),
                instances=tuple(doc["instances"]),
                rate=float(doc["rate"]),
                faults=faults,
                menu=tuple(doc.get("menu", KINDS)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a chaos schedule: {type(exc).__name__}: {exc}") from None

    def save(self, path: Path) -> Path:
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> Schedule:
        return cls.from_json(path.read_text())


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


class _Occupancy:
    """Which resources faults hold when: instances (killed or paused) and proxies (one fault each)."""

    def __init__(self, instances: Sequence[str], max_down: int, killable: Sequence[str], longest: float) -> None:
        self.instances = tuple(instances)
        self.killable = tuple(killable)
        self.max_down = max_down
        self.longest = longest
        self.spans: list[tuple[str, float, float]] = []

    def _overlapping(self, start: float, end: float) -> list[str]:
        return [key for key, a, b in self.spans if a < end + 0.5 and start < b + 0.5]

    def free(self, key: str, start: float, end: float) -> bool:
        busy = self._overlapping(start, end)
        if key.startswith("proc:"):
            downs = {k for k in busy if k.startswith("proc:")}
            return key not in downs and len(downs) < self.max_down
        dep, target = key.split("/", 1)
        if target == ALL:
            return not any(k.startswith(f"{dep}/") for k in busy)
        return key not in busy and f"{dep}/{ALL}" not in busy

    def take(self, key: str, start: float, end: float) -> None:
        self.spans.append((key, start, end))


def _draw(rng: random.Random, kind: str, at: float, room: float, occ: _Occupancy) -> Fault | None:
    """A fault of `kind` at `at` lasting at most `room` s, on a target the occupancy allows, or None."""
    instances = list(occ.killable if kind == "kill" else occ.instances)
    room = min(room, occ.longest)
    if kind in PROCESS_KINDS:
        duration = rng.uniform(0.5, 5.0) if kind == "kill" else _log_uniform(rng, 0.1, 30.0)
        duration = min(duration, room)
        rng.shuffle(instances)
        for name in instances:
            if occ.free(f"proc:{name}", at, at + duration):
                occ.take(f"proc:{name}", at, at + duration)
                return Fault(round(at, 2), kind, name, round(duration, 2))
        return None
    if kind in LINK_KINDS:
        dependency = rng.choice(DEPENDENCIES)
        scope = ALL if rng.random() < 0.3 else None
        low = 5.0 if kind == "flap" else 1.0
        duration = min(rng.uniform(low, 30.0), room)
        latency = round(_log_uniform(rng, 0.05, 2.0), 3) if kind == "slow" else None
        down = round(rng.uniform(0.2, 2.0), 2) if kind == "flap" else None
        up = round(rng.uniform(0.2, 3.0), 2) if kind == "flap" else None
        targets = [ALL] if scope else instances
        rng.shuffle(targets)
        for target in targets:
            key = f"{dependency}/{target}"
            if occ.free(key, at, at + duration):
                occ.take(key, at, at + duration)
                return Fault(round(at, 2), kind, target, round(duration, 2), dependency, latency, down, up)
        return None
    if kind == "writer_kill":
        return Fault(round(at, 2), kind, rng.choice(instances))
    if kind in WHOLE:
        target = WHOLE[kind]
        duration = min(rng.uniform(5.0, 60.0), room)
        if not occ.free(f"{target}/all", at, at + duration):
            return None
        occ.take(f"{target}/all", at, at + duration)
        return Fault(round(at, 2), kind, target, round(duration, 2))
    if kind in RING_KINDS:
        return Fault(round(at, 2), kind, "ring")
    raise ValueError(f"unknown fault kind {kind!r}")


def make_schedule(
    seed: int,
    seconds: float,
    instances: Sequence[str],
    *,
    rate: float = 5.0,
    menu: Sequence[str] = KINDS,
    start: float = 10.0,
    tail: float = 10.0,
    longest: float = 30.0,
    killable: Sequence[str] | None = None,
) -> Schedule:
    """The seeded schedule of a run of `seconds` over `instances` (see the module docstring).

    Args:
        seed: the random seed; the same arguments give the same schedule.
        seconds: the run's length; every fault ends by ``seconds - tail``.
        instances: the fleet's instance names (targets of process and per-instance link faults).
        rate: faults a minute on average (a Poisson process from `start`).
        menu: the kinds to draw from (each with its `WEIGHTS`).
        start: seconds before the first fault (the fleet settles).
        tail: seconds at the end with no fault.
        longest: no fault lasts longer (seconds).
        killable: the instances ``kill`` may pick (default: all); the others live the whole run.

    Raises:
        ValueError: an unknown kind in `menu`, or no instances.
    """
    unknown = [k for k in menu if k not in WEIGHTS]
    if unknown or not instances:
        raise ValueError(f"unknown fault kinds {unknown}" if unknown else "a schedule needs instances")
    rng = random.Random(seed)
    kinds = sorted(menu, key=KINDS.index)
    weights = [WEIGHTS[k] for k in kinds]
    occ = _Occupancy(sorted(instances), max(1, len(instances) // 2), sorted(killable or instances), longest)
    faults: list[Fault] = []
    end = seconds - tail
    at = start
    while True:
        at += rng.expovariate(rate / 60.0)
        if at >= end:
            break
        kind = rng.choices(kinds, weights)[0]
        fault = _draw(rng, kind, at, end - at, occ)
        if fault is not None and (fault.duration >= 0.1 or fault.kind in INSTANT):
            faults.append(fault)
    return Schedule(seed, float(seconds), tuple(sorted(instances)), float(rate), tuple(faults), tuple(kinds))
