"""The audit invariant: every event is stored once or counted as dropped, and ``audit verify`` passes.

At the end of the run (every member stopped cleanly, so each sink has flushed), the whole log is read
straight from PostgreSQL and indexed by token fingerprint (the fleet's audit key). Then, for every call a
client had an answer to (round 1's seal, round 2's or the forger's unseal), the instance that answered must
have stored its event (matched by the token's fingerprint, the operation and the process: an event names its
process ``host:pid:start``), unless

* that process's sink counted events as dropped (its last status said so; at most that many may be
  missing: the documented backpressure rule, and events a killed audit writer took with it), or
* the process was killed before the event could be stored ("what a crash loses", docs/audit.md): it was
  SIGKILLed within `KILL_LOSS` s of the event, or paused or cut from its audit store in between.

And: no event is stored twice (the same event again), no token is opened ``ok`` twice in the whole log (single
use, seen from the log), and ``mrtr-keys audit verify --checkpoints ANCHORS`` exits 0 (every chain's keyed
links, and the heads each instance anchored).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.chaos.fleet import Life, Member
from bench.chaos.nemesis import Timeline
from bench.chaos.traffic import Round

KILL_LOSS = 10.0
"""Seconds before a SIGKILL within which an unstored event counts as lost with the crash."""


@dataclass(frozen=True)
class Event:
    fp: str
    time: float
    pid: int
    op: str
    outcome: str
    reason: str | None
    kid: str | None


@dataclass
class AuditIndex:
    by_fingerprint: dict[str, list[Event]] = field(default_factory=dict)
    fenced: dict[int, list[float]] = field(default_factory=dict)
    """pid -> times of its ok events served fenced out (reason ``fenced-out``)."""
    total: int = 0
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)

    def find(self, fp: str, op: str, pid: int | None) -> list[Event]:
        return [e for e in self.by_fingerprint.get(fp, []) if e.op == op and (pid is None or e.pid == pid)]


def load_index(pg_url: str) -> AuditIndex:
    """Every seal and unseal event of the store at `pg_url`, by fingerprint."""
    from mrtr_keys.audit.events import parse_event_time
    from mrtr_keys.audit.writing.stores.base import Query
    from mrtr_keys.audit.writing.stores.url import open_store

    index = AuditIndex()
    store = open_store(pg_url)
    try:
        for record in store.iter_query(Query()):
            ev = record.event
            index.total += 1
            if ev.op not in ("seal", "unseal") or ev.fingerprint is None:
                continue
            pid = int(ev.instance.split(":")[1]) if ev.instance.count(":") >= 2 else -1
            when = parse_event_time(ev.time).timestamp()
            index.by_fingerprint.setdefault(ev.fingerprint, []).append(
                Event(ev.fingerprint, when, pid, ev.op, ev.outcome, ev.reason, ev.kid)
            )
            if ev.outcome != "ok" or ev.reason:
                index.reasons[f"{ev.op} {ev.outcome} {ev.reason}"] += 1
            if ev.outcome == "ok" and ev.reason == "fenced-out":
                index.fenced.setdefault(pid, []).append(when)
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()
    return index


def life_at(member: Member, at: float) -> Life | None:
    """The process of `member` that was running at POSIX time `at`."""
    found = None
    for life in member.lives:
        if life.started <= at and (life.ended is None or at <= life.ended):
            found = life
    return found


@dataclass
class Expected:
    """One event a client's answer says must exist."""

    member: str
    life: Life
    op: str
    fingerprint: str
    at: float
    round: Round


def expected_events(rounds: Iterable[Round], members: dict[str, Member], fp: Callable[[str], str]) -> list[Expected]:
    out: list[Expected] = []
    for r in rounds:
        if r.token is None:
            continue
        if r.t_sealed is not None and not r.forged:
            life = life_at(members[r.sealer], r.t0)
            if life is not None:
                out.append(Expected(r.sealer, life, "seal", fp(r.token), r.t0, r))
        if r.stage == "open" and r.outcome in ("ok", "rejected", "accepted") and r.opener and r.t_open:
            life = life_at(members[r.opener], r.t_open)
            if life is not None:
                out.append(Expected(r.opener, life, "unseal", fp(r.token), r.t_open, r))
    return out


RECORD_SLACK = 0.5
"""Seconds by which two openers' audit times may understate the time between two opens (their clocks are the
host's; an event's time is taken just after the decision)."""


def check_events(
    index: AuditIndex,
    expected: list[Expected],
    dropped: dict[int, int],
    timeline: Timeline,
    report: Callable[[float, str, str], None],
    spent_again: frozenset[str] | set[str] = frozenset(),
    record_life: float = 0.0,
) -> dict[str, int]:
    """Report each violation of the module docstring's rules through `report(at, what, evidence)`; the
    counts (``expected``, ``found``, ``lost_with_a_kill``, ``counted_dropped``). `spent_again`: fingerprints of
    tokens the checker found served twice by design (`Checker.spent_again`), which holds only if the second
    open came at least `record_life` seconds (the single-use record's: the ring's TTL + 60 s) after the
    first, by the openers' own audit times."""
    seals_seen: set[str] = set()
    missing: dict[int, list[Expected]] = collections.defaultdict(list)
    counts = collections.Counter[str]()
    for e in expected:
        if e.op == "seal":
            if e.fingerprint in seals_seen:  # a race's two rounds share one seal
                continue
            seals_seen.add(e.fingerprint)
        counts["expected"] += 1
        if index.find(e.fingerprint, e.op, e.life.pid):
            counts["found"] += 1
        else:
            missing[e.life.pid].append(e)
    for pid, lost in missing.items():
        allowed = dropped.get(pid, 0)
        for e in sorted(lost, key=lambda x: x.at):
            if _lost_with_kill(e, timeline):
                counts["lost_with_a_kill"] += 1
            elif allowed > 0:
                allowed -= 1
                counts["counted_dropped"] += 1
            else:
                report(
                    e.at,
                    f"audit event missing: {e.op} by {e.member} (pid {pid}) neither stored nor counted dropped",
                    f"token {e.round.token and e.round.token[:20]}..., process ended {e.life.how}, "
                    f"dropped {dropped.get(pid, 0)}, {len(lost)} missing in that process",
                )
    for events in index.by_fingerprint.values():
        keys = collections.Counter((e.op, e.outcome, e.pid, e.time) for e in events)  # the same event again
        for (op, outcome, pid, at), n in keys.items():
            if n > 1:
                report(at, f"audit event stored {n} times: {op} {outcome}", f"pid {pid}")
        oks = [e for e in events if e.op == "unseal" and e.outcome == "ok"]
        if len(oks) > 1 and events[0].fp not in spent_again:
            report(oks[1].time, "a token was opened twice (single use broken, in the audit log)", repr(oks))
        elif len(oks) > 1 and oks[1].time - oks[0].time < record_life - RECORD_SLACK:
            report(
                oks[1].time,
                f"a token was opened again {oks[1].time - oks[0].time:.1f} s after its first open, inside its "
                f"single-use record's {record_life:.0f} s",
                repr(oks),
            )
    return dict(counts)


def _lost_with_kill(e: Expected, timeline: Timeline) -> bool:
    life = e.life
    if life.how != "killed" or life.ended is None:
        return False
    if life.ended - e.at <= KILL_LOSS:
        return True
    for a in timeline.during(e.at, life.ended):
        f = a.fault
        if f.kind == "pause" and f.target == e.member:
            return True
        if f.dependency == "audit" and f.target in (e.member, "all"):
            return True
        if f.kind == "writer_kill" and f.target == e.member:
            return True
    return False


def verify(env: dict[str, str], run_cli: Callable[..., Any], anchors: Path) -> tuple[int, str]:
    """``mrtr-keys audit verify --checkpoints ANCHORS --json`` (the keyed chains, and the heads every instance
    anchored, issue 38): its exit code and output."""
    res = run_cli("audit", "verify", "--checkpoints", str(anchors), "--json", env=env, timeout=600)
    return res.code, (res.out + res.err)[-2000:]


def last_dropped(samples: Iterable[Any]) -> dict[int, int]:
    """pid -> the last ``dropped`` its audit sink reported in a probe (`bench.chaos.probes.Sample`)."""
    out: dict[int, int] = {}
    for s in samples:
        audit = s.doc.get("audit") if s.doc else None
        if s.pid is not None and isinstance(audit, dict) and isinstance(audit.get("dropped"), int):
            out[s.pid] = max(out.get(s.pid, 0), int(audit["dropped"]))
    return out


def fingerprinter(state: Path) -> Callable[[str], str]:
    from mrtr_keys.audit.writing.fingerprint import Fingerprinter, load_audit_key

    return Fingerprinter(load_audit_key(state, create=False)).fingerprint
