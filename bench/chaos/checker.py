"""The checker: the invariants of docs/reliability.md, held against what the clients, the log and the probes saw.

It never acts on the fleet. Each violation names its time, the faults active then (`Timeline.labels`) and
the evidence. The rules, in the order `classify_rounds`, `check_readiness` and `convergence` apply them:

* **Nothing forged or replayed is accepted.** A forger's call that was served, or a race whose two copies
  were both served, is a violation.
* **No round is rejected except by design.** A rejected round 2 takes its reason from the opener's audit
  event for that token (same process). By design: ``replay store unavailable`` while that instance's link
  to the replay store was faulted (`REPLAY_SLACK` s before, for the reconnect after a heal, to 1 s after);
  ``replayed`` when the other copy of a race won; ``expired`` when the round took longer than the TTL;
  ``revoked kid`` once that kid was revoked (issue 37).
  Any other reason, or none found, is a violation.
* **No round fails except on a killed or paused instance.** A failed call (refused, reset, past its
  deadline, a 5xx) must overlap a kill or pause of the instance it went to (`DOWN_SLACK` s either side).
* **Readiness follows docs/sidecar.md.** A sidecar whose link to a store has been cut or blackholed for
  `grace` s answers ``/readyz`` 503 naming that store in ``down``; one up for `STARTING` s and with no fault
  of any kind on it or its links for `grace` s answers 200 with no ``reload_error``, or is back to it within
  `grace` s; an instance that serves fenced out says so in ``/readyz`` (``fenced_out``; an MCP server in its
  status) and in its presence note.
* **The fleet converges.** After each heal, the time until every instance not under a fault serves the
  ring's generation is measured (p99 in the report); after the last heal it must be within 3 s.

Time bounds add the host's lateness over the same stretch (`tests.support.lateness.Relay`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.chaos.audit_check import AuditIndex, life_at
from bench.chaos.fleet import Member
from bench.chaos.nemesis import Applied, Timeline
from bench.chaos.probes import Samples
from bench.chaos.traffic import Round

DOWN_SLACK = 1.0
SKEW = 60.0
"""The MCP SDK's future-skew allowance (`_FUTURE_SKEW`): a single-use record lives a TTL + this."""
REPLAY_SLACK = 10.0
STORE_FAULTS = ("cut", "blackhole")
BY_DESIGN = {
    "replay store unavailable": "replay store down (on_store_error=deny)",
    "replayed": "single-use replay (the other copy of a race won)",
    "expired": "older than the TTL",
    "revoked kid": "a revoked key",
    "unknown kid": "the key a revocation put in place, unknown to an instance cut from its keystore",
}


@dataclass
class Violation:
    at: float
    what: str
    faults: list[str]
    evidence: str

    def to_dict(self) -> dict[str, Any]:
        return {"at": round(self.at, 3), "what": self.what, "faults": self.faults, "evidence": self.evidence[:2000]}


@dataclass
class Checker:
    members: dict[str, Member]
    timeline: Timeline
    ttl: float
    lateness: Callable[[float, float], float] = lambda start, end: 0.0
    """Seconds the host ran late over a stretch of POSIX time."""
    violations: list[Violation] = field(default_factory=list)
    rejections: collections.Counter[str] = field(default_factory=collections.Counter)
    failures: collections.Counter[str] = field(default_factory=collections.Counter)
    forger: collections.Counter[str] = field(default_factory=collections.Counter)
    revoked: list[tuple[float, str]] = field(default_factory=list)
    """(time, kid) of each revocation the nemesis made (`bench.chaos.ring_faults`)."""
    spent_again: list[Round] = field(default_factory=list)
    """Raw sidecar tokens served again after their single-use record expired (by design, `_forged`)."""

    def report(self, at: float, what: str, evidence: str = "", end: float | None = None) -> None:
        v = Violation(at, what, self.timeline.labels(at, end, slack=1.0), evidence)
        self.violations.append(v)
        print(f"[chaos] VIOLATION at {at:.3f}: {what} | faults: {v.faults} | {evidence[:300]}", flush=True)

    # ------------------------------------------------------------------ faults on one member

    def _on(self, name: str, start: float, end: float, slack: float, kinds: tuple[str, ...]) -> list[Applied]:
        return [
            a
            for a in self.timeline.during(start, end, slack)
            if a.fault.kind in kinds and a.fault.target == name and not a.note.startswith("not ")
        ]

    def down(self, name: str, start: float, end: float) -> bool:
        """True if `name` was killed or paused at some moment of [start, end] (with `DOWN_SLACK` and the host's
        lateness over the stretch)."""
        slack = DOWN_SLACK + self.lateness(start - DOWN_SLACK, end + DOWN_SLACK)
        return bool(self._on(name, start, end, slack, ("kill", "pause")))

    def link_faulted(self, name: str, dependency: str, start: float, end: float, kinds: tuple[str, ...]) -> bool:
        for a in self.timeline.during(start, end):
            f = a.fault
            if f.dependency == dependency and f.target in (name, "all") and f.kind in kinds:
                return True
        return False

    # ------------------------------------------------------------------ rounds

    def classify_rounds(self, rounds: list[Round], index: AuditIndex, fp: Callable[[str], str]) -> None:
        for i, r in enumerate(rounds):
            if r.forged:
                self._forged(r)
                continue
            if r.kind == "race" and r.twin is not None and r.twin > i and r.outcome == "ok":
                if rounds[r.twin].outcome == "ok":
                    self.report(r.t_open or r.t0, "both copies of a raced token were served", f"{r.opener}")
            if r.outcome == "ok":
                continue
            if r.kind == "ts":
                self._ts(r)
                continue
            refused = r.outcome == "rejected" and ("-32602" in r.detail or "HTTP" in r.detail)
            if not refused or r.opener is None or r.token is None or r.t_open is None:
                self._failed(r)
            else:
                self._rejected(r, rounds, index, fp)

    def _forged(self, r: Round) -> None:
        """A forger's call is never served, but for one documented case: a sidecar token whose payload has no
        ``exp`` (the traffic's raw payloads), replayed more than the ring's TTL + 60 s after it was first
        served, when its single-use record has expired by design (docs/single-use.md, "The record")."""
        outcome = r.outcome
        if outcome == "accepted":
            # Provisional: the opener may have served it any time up to the answer (a paused sidecar answers
            # a call sent before the record expired after it), and the record lives from the token's first
            # use, not its seal; `audit_check.check_events` judges it by the two opens' own audit times.
            late = r.t_sealed is not None and r.t1 - r.t_sealed > self.ttl + SKEW - DOWN_SLACK
            if r.kind == "replay" and r.detail == "sidecar" and late:
                outcome = "accepted, no exp and its record expired (by design)"
                self.spent_again.append(r)
            else:
                what = "replayed" if r.kind == "replay" else "forged (mutated)"
                self.report(r.t_open or r.t0, f"a {what} token was accepted by {r.opener}", r.detail)
        elif outcome == "failed" and r.kind == "replay" and r.opener in self.members:
            if self.members[r.opener].kind == "sidecar":
                # The forger gave up on a paused sidecar, which may serve the call when it resumes: the audit log
                # then holds a second open, judged by the two opens' audit times like an accepted replay's.
                self.spent_again.append(r)
        self.forger[f"{r.kind} {outcome}"] += 1

    def _ts(self, r: Round) -> None:
        """A TypeScript round that was not served: its sidecars (``sc-1+sc-2``) must have been down or paused,
        or their replay store faulted (the TypeScript codec's every sidecar failure is a refused round)."""
        names = r.sealer.split("+")
        start, end = r.t0 - DOWN_SLACK, r.t1 + DOWN_SLACK
        if any(self.down(n, start, end) for n in names):
            self.failures["typescript: a sidecar killed or paused"] += 1
        elif any(self.link_faulted(n, "replay", r.t0 - REPLAY_SLACK, end, _ANY_LINK) for n in names):
            self.rejections[BY_DESIGN["replay store unavailable"] + " (typescript)"] += 1
        elif any(r.t0 - self.ttl <= at <= end for at, _ in self.revoked):
            self.rejections[BY_DESIGN["revoked kid"] + " (typescript)"] += 1
        else:
            self.report(r.t0, f"typescript round {r.outcome} through {r.sealer}", r.detail, end=r.t1)

    def _failed(self, r: Round) -> None:
        name = r.sealer if r.stage == "seal" else (r.opener or r.sealer)
        start = r.t0 if r.stage == "seal" else (r.t_open or r.t0)
        if self.down(name, start, r.t1):
            self.failures["connection error to a killed or paused instance"] += 1
            return
        self.report(start, f"{r.kind} round failed at {r.stage} on {name}", r.detail, end=r.t1)

    def _rejected(self, r: Round, rounds: list[Round], index: AuditIndex, fp: Callable[[str], str]) -> None:
        assert r.opener is not None and r.token is not None and r.t_open is not None
        life = life_at(self.members[r.opener], r.t_open)
        events = [e for e in index.find(fp(r.token), "unseal", life.pid if life else None) if e.outcome != "ok"]
        events.sort(key=lambda e: e.time)
        retried = len(events) > 1 and events[1].time - events[0].time <= RETRY_AFTER_LOOK
        if retried and events[0].reason == "unknown kid":
            # The codec's unknown-kid look found a new ring and the unseal was tried again (codecs/base.py): the
            # log shows the first attempt's `unknown kid`, then the result, which is what the caller got.
            events = events[1:]
        reason = events[0].reason if events else None
        if reason is None and "replay_store_unavailable" in r.detail:
            reason = "replay store unavailable"
        why = None
        if reason == "replay store unavailable":
            faulted = self.link_faulted(r.opener, "replay", r.t_open - REPLAY_SLACK, r.t1 + 1.0, _ANY_LINK)
            why = BY_DESIGN[reason] if faulted else None
        elif reason in ("replayed", None) and r.twin is not None and rounds[r.twin].outcome == "ok":
            why = BY_DESIGN["replayed"] + ("" if reason else ", no event stored")
        elif reason == "expired":
            why = BY_DESIGN[reason] if r.t1 - r.t0 >= self.ttl else None
        elif reason == "revoked kid":
            kid = events[0].kid
            why = BY_DESIGN[reason] if any(k == kid and at <= r.t1 for at, k in self.revoked) else None
        elif reason == "unknown kid":
            # A revocation replaces the primary at once, not by phases (docs/rotation.md): an instance whose
            # keystore link is down since before it cannot load the new key, and `keys revoke` names it.
            revoked = [at for at, _ in self.revoked if r.t0 - self.ttl <= at <= r.t1]
            cut = any(self._held(r.opener, "keystore", at, r.t_open) for at in revoked)
            why = BY_DESIGN[reason] if cut else None
        elif reason is None and self.link_faulted(r.opener, "replay", r.t_open - REPLAY_SLACK, r.t1 + 1.0, _ANY_LINK):
            why = BY_DESIGN["replay store unavailable"] + ", no event stored"
        elif reason is None and any(k == token_kid(r.token) and at <= r.t1 for at, k in self.revoked):
            why = BY_DESIGN["revoked kid"] + ", no event stored"  # the token names its kid: revoked by then
        if why is not None:
            self.rejections[why] += 1
            return
        self.rejections[f"NOT BY DESIGN: {reason}"] += 1
        evidence = f"reason {reason!r} (audit events {events!r}); client saw {r.detail}; sealed by {r.sealer}"
        self.report(r.t_open, f"{r.kind} round 2 rejected on {r.opener}", evidence, end=r.t1)

    # ------------------------------------------------------------------ the rotator

    def check_rotation(self, failures: list[Any]) -> None:
        """Each rotation step that ended otherwise than done, waited out or beaten in a race is a violation,
        but one: a promote refused because the key its rotation began was revoked while it waited (the
        revocation ended that rotation; docs/rotation.md), counted in `rejections`."""
        for step in failures:
            revoked = any(step.began <= at <= step.ended for at, _ in self.revoked)
            if step.code == 1 and revoked and "nothing to promote" in step.message:
                self.rejections["a rotation ended by revoking its new key (the waiting promote refused)"] += 1
                continue
            self.report(step.began, f"rotate exited {step.code}", step.message, end=step.ended)

    # ------------------------------------------------------------------ readiness

    def check_readiness(self, samples: Samples, grace: float) -> collections.Counter[str]:
        """The readiness rules of the module docstring over every sidecar sample; counts of each rule checked.

        Not ready with no fault is a violation when it lasts longer than `grace` (+ the host's lateness): a
        shorter spell (``not ready, no fault, under the grace``) is a starved host's, when the audit writer or
        the shared PostgreSQL did not acknowledge for the store's 1 s (docs/audit.md), and is counted."""
        checked: collections.Counter[str] = collections.Counter()
        spell: dict[str, list[Any]] = {}
        unanswered: dict[str, float] = {}
        """Each sidecar's latest sample it did not answer: a store outage it could not see while paused, or
        while catching up after one, is judged from its first answer on (the grace then applies)."""
        for s in sorted(samples.members, key=lambda x: x.at):
            member = self.members[s.name]
            if member.kind != "sidecar":
                continue
            bound = grace + self.lateness(s.at - grace, s.at)
            down = s.doc.get("down") or {}
            if s.status is None:
                unanswered[s.name] = s.at
            answering = unanswered.get(s.name, float("-inf")) < s.at - bound
            for component in ("replay", "audit"):
                if (
                    s.status is not None
                    and answering
                    and self._held(s.name, component, s.at - bound, s.at + HELD_SLACK)
                ):
                    checked[f"{component} down -> 503"] += 1
                    if s.status != 503 or component not in down:
                        what = f"{s.name} /readyz {s.status} while its {component} store was down {bound:.1f} s"
                        self.report(s.at, what, repr(s.doc))
            life = life_at(member, s.at)
            settled = life is not None and life.started <= s.at - STARTING
            if not settled or self._any_fault(s.name, s.at - bound, s.at):
                self._end_spell(spell.pop(s.name, None), grace, checked)
                continue
            checked["no fault -> 200"] += 1
            if s.status == 200 and not s.doc.get("reload_error"):
                self._end_spell(spell.pop(s.name, None), grace, checked)
            else:
                spell.setdefault(s.name, []).append(s)
        for run in spell.values():
            self._end_spell(run, grace, checked)
        return checked

    def _end_spell(self, run: list[Any] | None, grace: float, checked: collections.Counter[str]) -> None:
        if not run:
            return
        first, last = run[0], run[-1]
        if last.at - first.at <= grace + self.lateness(first.at, last.at):
            checked["not ready, no fault, under the grace"] += 1
            return
        what = f"{first.name} /readyz {first.status} with no fault for {last.at - first.at:.1f} s"
        self.report(first.at, what, f"first {first.doc!r}; last {last.doc!r}", end=last.at)

    def _held(self, name: str, dependency: str, start: float, end: float) -> bool:
        """A cut or blackhole of `name`'s `dependency` link lasted all of [start, end]."""
        for a in self.timeline.during(start, end):
            f = a.fault
            if f.dependency == dependency and f.target in (name, "all") and f.kind in STORE_FAULTS:
                if a.began <= start and (a.ended is None or a.ended >= end):
                    return True
        return False

    def _any_fault(self, name: str, start: float, end: float, ignore: Applied | None = None) -> bool:
        for a in self.timeline.during(start, end):
            if a is ignore:
                continue
            f = a.fault
            if f.target in (name, "all", "state", "ring") or (f.kind == "writer_kill" and f.target == name):
                return True
        return False

    # ------------------------------------------------------------------ fenced out

    def check_fencing(self, samples: Samples, index: AuditIndex, heartbeat: float) -> collections.Counter[str]:
        """Each call served fenced out (an ok event with reason ``fenced-out``) while the instance's keystore link
        stays cut or blackholed: its ``/readyz`` (a sidecar) or status (an MCP server) says so in the next
        `FENCE_LOOK` s, and, when its audit link is sound, its heartbeat note within 3 heartbeats (+1 s)."""
        checked: collections.Counter[str] = collections.Counter()
        by_name: dict[str, list[Any]] = collections.defaultdict(list)
        for sample in samples.members:
            by_name[sample.name].append(sample)
        for name, member in self.members.items():
            for life in member.lives:
                for t in sorted(index.fenced.get(life.pid, [])):
                    self._fenced_at(name, life.pid, t, by_name[name], samples, heartbeat, checked)
        return checked

    def _fenced_at(
        self, name: str, pid: int, t: float, series: list[Any], samples: Samples, heartbeat: float, checked: Any
    ) -> None:
        says = [s for s in series if s.pid == pid and t <= s.at <= t + FENCE_LOOK and s.status is not None]
        says = [s for s in says if self._held(name, "keystore", t, s.at + HELD_SLACK)]
        if says:
            checked["fenced out -> /readyz or status"] += 1
            if not any(_fenced(s.doc) for s in says):
                self.report(t, f"{name} served fenced out and its /readyz or status did not say so", repr(says[0].doc))
        window = 3 * heartbeat + 1.0 + self.lateness(t, t + 3 * heartbeat + 1.0)
        if not self._held(name, "keystore", t, t + window) or self.link_faulted(
            name, "audit", t, t + window, _ANY_LINK
        ):
            return
        if self._on(name, t, t + window, 0.0, ("kill", "pause")):
            return
        checked["fenced out -> heartbeat note"] += 1
        notes = [rows.get(name) for at, rows in samples.presence if t <= at <= t + window]
        if not any(row and row[1] and "fenced out" in row[1] for row in notes):
            self.report(
                t, f"{name} served fenced out and its heartbeat never said so in {window:.1f} s", repr(notes[-3:])
            )

    # ------------------------------------------------------------------ convergence

    def convergence(self, samples: Samples) -> list[float]:
        """After each heal that left an instance behind the ring's generation: seconds until every instance it
        affected (and not under another fault by then) serves the ring's generation (sampled every 0.5 s)."""
        by_name: dict[str, list[Any]] = collections.defaultdict(list)
        for s in samples.members:
            by_name[s.name].append(s)
        out: list[float] = []
        for a in self.timeline.applied:
            if a.ended is None or a.fault.duration <= 0 or a.note.startswith("not "):
                continue
            target = a.fault.target
            names = [target] if target in by_name else sorted(by_name)
            done = self._converged_after(a, names, by_name, samples)
            if done is not None:
                out.append(done - a.ended)
        return out

    def _converged_after(
        self, healed: Applied, names: list[str], by_name: dict[str, list[Any]], samples: Samples
    ) -> float | None:
        assert healed.ended is not None
        heal = healed.ended

        def behind(name: str, t: float, since: float) -> bool | None:
            """Whether `name`'s latest sample in [since, t] is behind the ring (None: under another fault)."""
            if self._any_fault(name, t, t, ignore=healed):
                return None
            latest = [s for s in by_name[name] if since <= s.at <= t]
            if not latest or latest[-1].generation is None:
                return True
            return latest[-1].generation != samples.ring_generation(latest[-1].at)

        if not any(behind(n, heal, heal - 2.0) for n in names):
            return None  # nobody was behind at the heal: nothing to converge
        times = sorted({s.at for n in names for s in by_name[n] if heal <= s.at <= heal + 60})
        for t in times:
            if not any(behind(n, t, heal) for n in names):
                return t
        return None


_ANY_LINK = ("cut", "blackhole", "slow", "flap")
FENCE_LOOK = 2.0
RETRY_AFTER_LOOK = 2.0
"""Seconds within which an unseal's second event (same token, same process) is the retry after an unknown-kid
look: the look waits for a keystore check 1 s at most (`mrtr_keys.codecs.fence.DEFAULT_WAIT`), + slack."""
HELD_SLACK = 0.5
"""A fault must still hold this long after a sample to count as holding at it (the heal's restore and the
nemesis's record of it are not one instant)."""
STARTING = 15.0
"""Seconds after its start a process is not judged by the readiness rules (its audit writer is starting)."""


def token_kid(token: str) -> str | None:
    """The kid a token names (``PREFIX.`` then base64url of kid || body, docs/token-format.md), or None."""
    from mrtr_keys.token import MalformedToken, unpack

    prefix, dot, _ = token.partition(".")
    try:
        return unpack(prefix + dot, token)[0].hex() if dot else None
    except (MalformedToken, ValueError):
        return None


def _fenced(doc: dict[str, Any]) -> bool:
    """True if a probe's answer says the instance serves fenced out (sidecar ``/readyz`` or MCP status)."""
    fence = doc.get("fence")
    return bool(doc.get("fenced_out")) or (isinstance(fence, dict) and bool(fence.get("note")))
