"""The chaos checker's rules (`bench.chaos.checker`, issue 40, docs/reliability.md) on hand-made evidence.

Each violation names its time, the faults active then and the evidence; what the design allows is counted by
reason instead (a replay store down under ``on_store_error="deny"``, the losing copy of a race, a round
older than the TTL), as is a failure on an instance that was killed or paused at that moment.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench.chaos.audit_check import AuditIndex, Event, check_events
from bench.chaos.checker import Checker
from bench.chaos.fleet import Life, Member
from bench.chaos.nemesis import Applied, Timeline
from bench.chaos.probes import Sample, Samples
from bench.chaos.schedule import Fault
from bench.chaos.traffic import Round

T = 1_000_000.0
PIDS = {"mcp-1": 101, "mcp-2": 102}


def _fp(token: str) -> str:
    return "fp-" + token


def _checker(*applied: Applied) -> Checker:
    members = {
        name: Member(name, "mcp", [], {}, 0, Path("."), {}, lives=[Life(pid, T - 100)]) for name, pid in PIDS.items()
    }
    return Checker(members, Timeline(list(applied)), ttl=30.0)


def _round(outcome: str, detail: str = "", **kw: object) -> Round:
    r = Round("mcp", "mcp-1", "mcp-2", t0=T, t_sealed=T + 0.1, t_open=T + 0.4, outcome=outcome, token="tok")
    r.t1, r.detail = T + 0.6, detail
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def _index(reason: str | None, pid: int = 102) -> AuditIndex:
    index = AuditIndex()
    if reason is not None:
        index.by_fingerprint["fp-tok"] = [Event("fp-tok", T + 0.5, pid, "unseal", "rejected", reason, "k1")]
    return index


def _fault(kind: str, target: str, at: float, until: float, dependency: str | None = None) -> Applied:
    return Applied(Fault(at - T, kind, target, until - at, dependency), began=at, ended=until)


def test_a_round_failed_on_a_paused_instance_is_counted_not_a_violation() -> None:
    checker = _checker(_fault("pause", "mcp-2", T + 0.2, T + 5))
    checker.classify_rounds([_round("failed", "ReadTimeout: ", stage="open")], _index(None), _fp)
    assert checker.violations == []
    assert checker.failures == {"connection error to a killed or paused instance": 1}


def test_a_round_failed_on_a_healthy_instance_is_a_violation_naming_the_faults_and_the_evidence() -> None:
    checker = _checker(_fault("slow", "mcp-2", T - 1, T + 5, "audit"))
    checker.classify_rounds([_round("failed", "ConnectError: refused", stage="open")], _index(None), _fp)
    [v] = checker.violations
    assert v.what == "mcp round failed at open on mcp-2"
    assert v.faults == ["-1.0 s slow audit/mcp-2 for 6 s"]
    assert v.evidence == "ConnectError: refused"


def test_a_rejection_for_a_replay_store_down_is_by_design_only_while_the_link_is_faulted() -> None:
    rejected = _round("rejected", "-32602 Invalid or expired requestState")
    down = _checker(_fault("blackhole", "mcp-2", T - 3, T + 2, "replay"))
    down.classify_rounds([rejected], _index("replay store unavailable"), _fp)
    assert down.violations == []
    assert down.rejections == {"replay store down (on_store_error=deny)": 1}
    healthy = _checker()
    healthy.classify_rounds([rejected], _index("replay store unavailable"), _fp)
    assert [v.what for v in healthy.violations] == ["mcp round 2 rejected on mcp-2"]


def test_a_rejection_for_a_retired_or_unknown_key_is_a_violation() -> None:
    checker = _checker(_fault("cut", "all", T - 3, T + 2, "keystore"))
    checker.classify_rounds([_round("rejected", "-32602 Invalid or expired requestState")], _index("retired kid"), _fp)
    [v] = checker.violations
    assert "'retired kid'" in v.evidence and v.faults == ["-3.0 s cut keystore/all for 5 s"]


def test_an_accepted_forgery_and_a_token_served_twice_in_a_race_are_violations() -> None:
    forged = _round("accepted", kind="replay")
    first, second = _round("ok", kind="race", twin=1), _round("ok", kind="race", twin=0)
    checker = _checker()
    checker.classify_rounds([forged], _index(None), _fp)
    checker.classify_rounds([first, second], _index(None), _fp)
    assert [v.what for v in checker.violations] == [
        "a replayed token was accepted by mcp-2",
        "both copies of a raced token were served",
    ]


def test_the_losing_copy_of_a_race_is_rejected_by_design() -> None:
    won, lost = _round("ok", kind="race", twin=1), _round("rejected", "-32602 x", kind="race", twin=0)
    checker = _checker()
    checker.classify_rounds([won, lost], _index("replayed"), _fp)
    assert checker.violations == []
    assert checker.rejections == {"single-use replay (the other copy of a race won)": 1}


def test_a_raw_sidecar_token_replayed_after_its_record_expired_is_counted_apart_not_before() -> None:
    """docs/single-use.md: a payload without ``exp`` is single-use for the ring's TTL + 60 s after its first use."""
    late = _round("accepted", "sidecar", kind="replay", t_sealed=T - 95, t_open=T)
    early = _round("accepted", "sidecar", kind="replay", t_sealed=T - 30, t_open=T)
    enveloped = _round("accepted", "mcp", kind="replay", t_sealed=T - 95, t_open=T)
    checker = _checker()
    checker.classify_rounds([late, early, enveloped], _index(None), _fp)
    assert [v.what for v in checker.violations] == ["a replayed token was accepted by mcp-2"] * 2
    assert checker.forger == {"replay accepted, no exp and its record expired (by design)": 1, "replay accepted": 2}


def test_a_rejection_without_an_event_is_by_design_when_the_token_names_a_key_revoked_by_then() -> None:
    """The opener killed before it stored the event: the token still names its kid (docs/token-format.md)."""
    kid = "20234d80"
    token = "mk1.ICNNgEJqIMsIqBFOkMwnvriZ4oJuMZuVZyP7lGwN-T3YzA"  # kid 20234d80
    rejected = _round("rejected", "-32602 Invalid or expired requestState", token=token)
    checker = _checker()
    checker.revoked = [(T - 5, kid)]
    checker.classify_rounds([rejected], _index(None), _fp)
    assert checker.violations == [] and checker.rejections == {"a revoked key, no event stored": 1}
    too_early = _checker()
    too_early.revoked = [(T + 5, kid)]
    too_early.classify_rounds([rejected], _index(None), _fp)
    assert [v.what for v in too_early.violations] == ["mcp round 2 rejected on mcp-2"]


def test_a_replay_answered_after_its_record_expired_is_judged_by_the_two_opens_audit_times() -> None:
    """Issue 40's 60-minute run (seed 2026): a replay sent 87 s after the token's first open reached a sidecar
    that a pause held until the record (TTL 30 s + 60 s) had expired; it was opened 94.3 s after the first open,
    as designed, but judged by the time it was sent it was reported as single use broken. The answer's time
    makes it a candidate, and the openers' audit times decide: a second open inside the record's life is still
    a violation."""
    sent_early = _round("accepted", "sidecar", kind="replay", t_sealed=T - 87, t_open=T)
    sent_early.t1 = T + 7.4
    checker = _checker()
    checker.classify_rounds([sent_early], _index(None), _fp)
    assert checker.violations == []
    assert checker.forger == {"replay accepted, no exp and its record expired (by design)": 1}

    def opens(gap: float) -> AuditIndex:
        index = AuditIndex()
        index.by_fingerprint["fp-tok"] = [
            Event("fp-tok", T - 87, 102, "unseal", "ok", None, "k1"),
            Event("fp-tok", T - 87 + gap, 101, "unseal", "ok", None, "k1"),
        ]
        return index

    for gap, expected in ((94.3, []), (60.0, ["a token was opened again 60.0 s after its first open"])):
        reported: list[tuple[float, str, str]] = []
        check_events(opens(gap), [], {}, Timeline([]), _collect(reported), {"fp-tok"}, record_life=90.0)
        assert [what.split(", inside")[0] for _, what, _ in reported] == expected


def _collect(into: list[tuple[float, str, str]]) -> Callable[[float, str, str], None]:
    return lambda at, what, evidence: into.append((at, what, evidence))


def test_readiness_is_judged_from_a_sidecars_first_answer_after_it_could_not_answer() -> None:
    """Issue 40's 60-minute run (seed 2026): a sidecar resumed from a 15 s pause into an audit store outage
    answered no probe for 5 s more while it caught up, then said 200 (its first events after the pause not yet
    unacknowledged for the store's 1 s) and 503 two seconds later; judged from the outage's start, that was a
    violation. A sidecar that answers nothing cannot say anything untrue: the grace runs from its first answer,
    and a 200 past it is still a violation."""
    sc = Member("sc-1", "sidecar", [], {}, 0, Path("."), {}, lives=[Life(201, T - 100)])
    outage = _fault("blackhole", "all", T, T + 60, dependency="audit")
    checker = Checker({"sc-1": sc}, Timeline([outage]), ttl=30.0)
    down = {"ready": False, "down": {"audit": "silent"}}
    samples = Samples(
        members=[
            Sample(T + 10, "sc-1", 201, None),  # paused, then catching up: no answer
            Sample(T + 12, "sc-1", 201, 200, {"ready": True}),  # 2 s after its first answer: within the grace
            Sample(T + 14, "sc-1", 201, 503, down),
            Sample(T + 22, "sc-1", 201, 200, {"ready": True}),  # answering for 10 s and still 200: a violation
        ]
    )
    checker.check_readiness(samples, grace=5.0)
    assert [(v.at, v.what) for v in checker.violations] == [
        (T + 22, "sc-1 /readyz 200 while its audit store was down 5.0 s")
    ]


def test_an_unknown_kid_is_by_design_only_on_an_instance_cut_from_its_keystore_across_a_revocation() -> None:
    """Issue 40's second 60-minute run (seed 2026): a revocation replaced the primary at once while one sidecar
    was cut from the keystore; a token the other sidecar sealed with the new key was refused on it as unknown
    kid. A revocation is not phased (docs/rotation.md: keys revoke names such instances), so that is by
    design; the same refusal on an instance whose keystore answered is a violation."""
    cut = _fault("cut", "mcp-2", T - 10, T + 10, dependency="keystore")
    for applied, expected in (((cut,), []), ((), ["mcp round 2 rejected on mcp-2"])):
        checker = _checker(*applied)
        checker.revoked.append((T - 1.0, "k0"))
        checker.classify_rounds([_round("rejected", "-32602")], _index("unknown kid"), _fp)
        assert [v.what for v in checker.violations] == expected


def test_an_unknown_kid_followed_by_the_retry_after_the_look_is_judged_by_the_retry() -> None:
    """Issue 40's third 60-minute run (seed 2026): a revocation's new key sealed a raced round on mcp-1; the copy
    on mcp-2 met `unknown kid` 17 ms before mcp-2 loaded the new ring, its look found it, and the retry was
    refused as `replayed` (the other copy had won): the log holds both events (codecs/base.py), and the result,
    the second, is by design. An `unknown kid` with no retry stays a violation."""
    won, lost = _round("ok", kind="race", twin=1), _round("rejected", "-32602 x", kind="race", twin=0)
    index = _index("unknown kid")
    index.by_fingerprint["fp-tok"].append(Event("fp-tok", T + 0.52, 102, "unseal", "rejected", "replayed", "k1"))
    checker = _checker()
    checker.classify_rounds([won, lost], index, _fp)
    assert checker.violations == []
    assert checker.rejections == {"single-use replay (the other copy of a race won)": 1}
    alone = _checker()
    alone.classify_rounds([won, lost], _index("unknown kid"), _fp)
    assert [v.what for v in alone.violations] == ["race round 2 rejected on mcp-2"]


def test_a_replay_the_forger_gave_up_on_at_a_paused_sidecar_is_judged_by_the_audit_times() -> None:
    """Issue 40's fourth 60-minute run (seed 2026): the forger's replay of a raw sidecar token timed out on a sidecar
    paused for 24 s, which served it when it resumed, 92.6 s after the token's first open (its single-use record,
    TTL 30 s + 60 s, had expired: by design). The forger saw a failure, so the checker did not count the token
    among those it may find opened again and reported single use broken. A failed replay at a sidecar is now such
    a candidate (the two opens' audit times decide, as for an accepted one); one at an MCP server is not."""
    members = {
        "sc-1": Member("sc-1", "sidecar", [], {}, 0, Path("."), {}, lives=[Life(201, T - 100)]),
        "mcp-2": Member("mcp-2", "mcp", [], {}, 0, Path("."), {}, lives=[Life(102, T - 100)]),
    }
    checker = Checker(members, Timeline([]), ttl=30.0)
    at_sidecar = _round("failed", "ReadTimeout: timed out", kind="replay", opener="sc-1", t_sealed=T - 90)
    at_server = _round("failed", "ReadTimeout: timed out", kind="replay", opener="mcp-2", t_sealed=T - 90)
    checker.classify_rounds([at_sidecar, at_server], _index(None), _fp)
    assert checker.violations == []
    assert checker.spent_again == [at_sidecar]
    assert checker.forger == {"replay failed": 2}
