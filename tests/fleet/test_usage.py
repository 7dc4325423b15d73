"""Fleet-wide seal counts that are never below the truth (`mrtr_keys.fleet.usage`, issue 36).

Each test drives one `UsageReporter` by hand (`run_round`, no thread) over a real SQLite presence store and a
real codec of this process, whose token core counts every seal, unseal and rejection (`mrtr_keys.codecs.usage`).
What a user sees is the store's ``key_usage`` rows and their totals (what ``keys list`` and ``fleet status``
print); the process-level runs (PostgreSQL, SIGKILL, sidecars) are in tests/e2e/test_usage_fleet.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.audit.events import format_ts
from mrtr_keys.audit.writing.stores.key_usage import SETTLED, totals
from mrtr_keys.audit.writing.stores.url import open_store
from mrtr_keys.changes.apply import apply_change
from mrtr_keys.changes.budget import set_budget
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.codecs.usage import NEVER, OVER_BUDGET, over_budget, usage_for
from mrtr_keys.errors import AuditUnavailable
from mrtr_keys.fleet.usage import MIN_BLOCK, SETTLE_AFTER, UsageReporter
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.budgets import block_of, budget_of

AUD = "billing"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[FileKeystore, Any]]:
    keystore = FileKeystore(tmp_path / "keyring.json")
    create_ring(keystore)
    store = open_store(f"sqlite://{tmp_path / 'audit.db'}")
    yield keystore, store
    store.close()


def _reporter(store: Any, codec: LocalAESGCMCodec, name: str = "pod-a") -> UsageReporter:
    reporter = UsageReporter(store, instance=name)
    reporter.watch(lambda: codec.ring)  # one round at once: the primary is reserved before it seals
    return reporter


def _totals(store: Any, codec: LocalAESGCMCodec) -> dict[str, Any]:
    return totals(store.usage_rows(codec.ring.ring_id))


def test_the_primary_is_reserved_before_it_seals_and_the_total_is_never_below_the_truth(fleet: Any) -> None:
    keystore, store = fleet
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    reporter = _reporter(store, codec)
    kid = codec.ring.primary.kid
    first = _totals(store, codec)[kid]
    assert (first.sealed, first.seals) == (0, MIN_BLOCK)  # reserved ahead, nothing sealed yet
    n = MIN_BLOCK + 250
    tokens = [codec.seal(b"x") for _ in range(n)]  # past the first block without a round: the core wakes it
    assert reporter._wake.is_set()  # one comparison on the hot path asked for the next block
    for token in tokens[:50]:
        codec.unseal(token)
    with pytest.raises(InvalidRequestState):
        codec.unseal(tokens[0][:-2] + ("BA" if tokens[0].endswith("AA") else "AA"))
    assert reporter.run_round()
    t = _totals(store, codec)[kid]
    assert (t.sealed, t.unseals, t.rejections) == (n, 50, 1)
    assert n <= t.seals <= n + t.blocks and t.blocks <= block_of(budget_of(codec.ring, codec.ring.primary))
    assert reporter.totals[codec.ring.ring_id][kid] == t  # what the instance itself reports (metrics, /readyz)


def test_the_first_reservation_outlasts_a_store_round_trip_at_a_busy_sidecars_rate(fleet: Any) -> None:
    """Before the first seal nothing is known of the rate, and the next block is written only once half of the
    first is spent. That half must cover a busy sidecar (20,000 seals a second) for a store round trip under load
    (0.25 s): a burst that spends it first seals past the reservation, and a SIGKILL then loses those seals
    (a 100-seal block was outrun by thousands of seals over PostgreSQL)."""
    keystore, store = fleet
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    _reporter(store, codec)
    first = _totals(store, codec)[codec.ring.primary.kid]
    assert first.sealed == 0 and first.seals // 2 >= 20_000 * 0.25


def test_a_budget_lowered_on_a_live_fleet_shrinks_the_reservations_in_force(fleet: Any) -> None:
    """``keys budget 4000`` on a running fleet: each instance still held a block reserved under the old budget
    (10,000 seals), which alone put the key at 250 % of its new budget (over-budget audit reasons, a critical
    alert, a rotation by use). A reservation larger than 1 % of the budget in force is cut back at the next
    round, never below the seals made."""
    keystore, store = fleet
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    reporter = _reporter(store, codec)
    kid = codec.ring.primary.kid
    for _ in range(30):
        codec.seal(b"x")
    assert reporter.run_round() and _totals(store, codec)[kid].seals >= MIN_BLOCK
    apply_change(keystore, "budget", lambda ring, now: set_budget(ring, 4000, None, now))
    assert codec.reload() and reporter.run_round()
    t = _totals(store, codec)[kid]
    assert t.sealed == 30 and 30 <= t.seals <= 30 + block_of(4000)
    assert kid not in over_budget


def test_a_killed_process_leaves_its_reservation_counted_until_it_is_settled(fleet: Any) -> None:
    keystore, store = fleet
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    killed = _reporter(store, codec, "pod-killed")
    for _ in range(40):
        codec.seal(b"x")  # within its reservation: no round needed
    # SIGKILL here: no final round. The row still holds the reservation, which covers every seal made.
    (row,) = store.usage_rows(codec.ring.ring_id)
    assert row.state == "running" and row.seals >= 40 >= row.seals - row.block
    # Much later a reporter folds the silent source into the settled row, reservation and all.
    assert store.settle_usage(codec.ring.ring_id, before="9999-12-31T00:00:00.000000Z") == 1
    (settled,) = store.usage_rows(codec.ring.ring_id)
    assert (settled.source, settled.seals, settled.sealed) == (SETTLED, row.seals, row.sealed)
    assert killed.source != SETTLED


def test_a_clean_stop_writes_the_exact_count_and_folds_it_into_the_settled_row(fleet: Any) -> None:
    keystore, store = fleet
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    other = LocalAESGCMCodec(keystore, audience="payments")  # another audience, the same kid: one count
    kid = codec.ring.primary.kid
    reporter = _reporter(store, codec)
    for _ in range(7):
        codec.unseal(other.unseal(other.seal(b"x")) and codec.seal(b"y"))
    reporter.stop()
    (row,) = store.usage_rows(codec.ring.ring_id)
    assert (row.source, row.kid, row.seals, row.sealed, row.unseals, row.block) == (SETTLED, kid, 14, 14, 14, 0)


def test_an_old_primary_settles_to_its_exact_count_once_it_stops_sealing(fleet: Any) -> None:
    keystore, store = fleet
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    reporter = _reporter(store, codec)
    old = codec.ring.primary.kid
    for _ in range(30):
        codec.seal(b"x")
    begun = run_step(keystore, "begin")
    assert codec.reload() and reporter.run_round()
    new = begun.details["new"]
    assert _totals(store, codec)[new].seals == MIN_BLOCK  # the begun key is reserved before promote makes it seal
    run_step(keystore, "promote")
    assert codec.reload()
    codec.seal(b"z")
    reporter.run_round()  # the old key sealed nothing since: its reservation is given back
    t = _totals(store, codec)
    assert (t[old].seals, t[old].sealed) == (30, 30)
    assert t[new].sealed == 1 and t[new].seals >= 1


class FlakyStore:
    """The presence store, refusing every key_usage write while `down` (an outage)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.down = inner, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def put_usage(self, rows: Any) -> None:
        if self.down:
            raise AuditUnavailable("cannot write to the audit store: connection refused")
        self.inner.put_usage(rows)


def test_a_store_outage_never_stops_sealing_and_the_counts_arrive_when_it_is_back(
    fleet: Any, caplog: pytest.LogCaptureFixture
) -> None:
    keystore, inner = fleet
    store = FlakyStore(inner)
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    reporter = _reporter(store, codec)
    kid = codec.ring.primary.kid
    store.down = True
    with caplog.at_level(logging.WARNING, logger="mrtr_keys.usage"):
        assert not reporter.run_round()
        assert not reporter.run_round()
    assert reporter.error and "connection refused" in reporter.error
    assert [r.message for r in caplog.records].count(f"seal counts not written (instance pod-a): {reporter.error}") == 1
    assert usage_for(codec.ring.ring_id).kid(kid).mark == NEVER  # nothing to wake while it is down: no wake storm
    for _ in range(300):
        codec.seal(b"x")  # past the reservation, sealing goes on
    store.down = False
    assert reporter.run_round() and reporter.error is None
    t = _totals(inner, codec)[kid]
    assert t.sealed == 300 and t.seals >= 300


def test_a_quiet_process_is_never_settled_while_it_lives(fleet: Any) -> None:
    """A sidecar idle for hours (a night) writes nothing new; if its rows looked silent, a settle (any reporter's,
    every 10 minutes, of sources silent for an hour) would fold them into the settled row while it still reports
    them, and its next write would count its whole history twice. It refreshes its rows instead."""
    keystore, store = fleet
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    clock = [1_800_000_000.0]
    reporter = UsageReporter(store, instance="pod-quiet", clock=lambda: clock[0])
    reporter.watch(lambda: codec.ring)
    for _ in range(30):
        codec.seal(b"x")
    assert reporter.run_round()
    for _ in range(6):  # two hours without a seal, a round now and then
        clock[0] += 1200
        assert reporter.run_round()
    assert store.settle_usage(codec.ring.ring_id, before=format_ts(clock[0] - SETTLE_AFTER)) == 0
    codec.seal(b"morning")
    assert reporter.run_round()
    t = _totals(store, codec)[codec.ring.primary.kid]
    assert t.sealed == 31 and 31 <= t.seals <= 31 + t.blocks


def test_counts_settled_while_a_process_was_cut_off_are_not_counted_twice(fleet: Any) -> None:
    """A process cut from the store for over an hour looks silent and another reporter settles its rows (its
    counts, reservation included, move to the settled row). Once the store answers again it reports only what
    came after, not its whole history again."""
    keystore, inner = fleet
    store = FlakyStore(inner)
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    clock = [1_800_000_000.0]
    reporter = UsageReporter(store, instance="pod-cut", clock=lambda: clock[0])
    reporter.watch(lambda: codec.ring)
    for _ in range(30):
        codec.unseal(codec.seal(b"x"))
    assert reporter.run_round()
    store.down = True
    for _ in range(6):
        clock[0] += 1200
        assert not reporter.run_round()
    assert inner.settle_usage(codec.ring.ring_id, before=format_ts(clock[0] - SETTLE_AFTER)) == 1  # another's
    store.down = False
    codec.unseal(codec.seal(b"back"))
    assert reporter.run_round()
    t = _totals(inner, codec)[codec.ring.primary.kid]
    assert (t.sealed, t.unseals) == (31, 31) and 31 <= t.seals <= 31 + t.blocks
    reporter.stop()
    t = _totals(inner, codec)[codec.ring.primary.kid]
    assert (t.sealed, t.unseals) == (31, 31) and t.seals >= 31


def test_one_process_counts_each_seal_once_whatever_its_presence_names_and_codecs(tmp_path: Path) -> None:
    """The tallies are the process's: two presence names in one process (two MCP servers of one app) report them
    through one reporter, and a codec closed and opened again counts on from what the first one reported. Each
    had reported the process's whole count again (40 for 20 sealed; then 65 for 25)."""
    from mrtr_keys.factory import request_state_security

    keystore = FileKeystore(tmp_path / "keyring.json")
    create_ring(keystore)
    url = f"sqlite://{tmp_path / 'audit.db'}"

    def codec(audience: str, name: str) -> Any:
        return request_state_security(keystore, audience=audience, audit=url, instance=name, reload_every=0).codec

    a, b = codec("billing", "web-a"), codec("payments", "web-b")
    kid = a.ring.primary.kid
    try:
        for _ in range(10):
            a.unseal(a.seal(b"x"))
            b.seal(b"y")
        assert all(c.presence.usage().run_round() for c in (a, b))  # each presence's counts written
        t = totals(a.presence.store.usage_rows(a.ring.ring_id))[kid]
        assert (t.sealed, t.unseals) == (20, 10)
    finally:
        a.presence.stop()
        b.presence.stop()
    again = codec("billing", "web-c")
    try:
        for _ in range(5):
            again.seal(b"z")
        assert again.presence.usage().run_round()
        t = totals(again.presence.store.usage_rows(again.ring.ring_id))[kid]
        assert (t.sealed, t.unseals) == (25, 10) and 25 <= t.seals <= 25 + t.blocks
    finally:
        again.presence.stop()
    t = totals(again.presence.store.usage_rows(again.ring.ring_id))[kid]
    assert (t.seals, t.sealed, t.unseals, t.blocks) == (25, 25, 10, 0)


def test_half_the_budget_warns_once_and_seals_past_it_are_audited_over_budget(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from mrtr_keys.audit.writing.stores.base import Query
    from mrtr_keys.factory import request_state_security

    keystore = FileKeystore(tmp_path / "keyring.json")
    create_ring(keystore)
    ring = keystore.load()
    keystore.save(replace(ring.next_generation(), seal_budget=400), expected_generation=ring.generation)
    url = f"sqlite://{tmp_path / 'audit.db'}"
    codec: Any = request_state_security(keystore, audience=AUD, audit=url, instance="pod-b", reload_every=0).codec
    reporter = codec.presence.usage()
    kid = codec.ring.primary.kid
    assert block_of(400) == 4  # 1 % of the budget: reservations alone never cross a threshold
    try:
        with caplog.at_level(logging.WARNING, logger="mrtr_keys.usage"):
            for _ in range(200):
                codec.seal(b"x")
            reporter.run_round()
            reporter.run_round()
        said = [r.message for r in caplog.records if r.name == "mrtr_keys.usage"]
        assert len(said) == 1 and said[0].startswith(f"key {kid} has used 20"), said
        assert (
            "of its seal budget of 400 (5" in said[0]
            and "rotate it: mrtr-keys rotate next --if-used-over 0.5" in said[0]
        )
        for _ in range(201):
            codec.seal(b"x")
        reporter.run_round()
        assert kid in over_budget
        codec.seal(b"past it")  # sealing never stops
        assert codec._observer.sink.flush(timeout=10)
        seals = open_store(url).query(Query(op="seal"))
        assert seals[-1].event.reason == OVER_BUDGET and seals[0].event.reason is None
    finally:
        over_budget.discard(kid)
        codec.presence.stop()


def test_a_key_found_past_its_budget_is_warned_of_in_one_line(fleet: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A key an instance first sees past its whole budget (``keys budget`` lowered below the seals made, or an
    instance started late) crossed both thresholds in one round, and each logged the same WARNING: the line was
    written twice, word for word."""
    keystore, store = fleet
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    reporter = _reporter(store, codec)
    kid = codec.ring.primary.kid
    try:
        with caplog.at_level(logging.WARNING, logger="mrtr_keys.usage"):
            for _ in range(60):
                codec.seal(b"x")
            assert reporter.run_round()
            apply_change(keystore, "budget", lambda ring, now: set_budget(ring, 40, None, now))
            assert codec.reload() and reporter.run_round()
            reporter.run_round()
        said = [r.message for r in caplog.records if r.name == "mrtr_keys.usage"]
        assert len(said) == 1, said
        assert said[0].startswith(f"key {kid} has used 6") and "of its seal budget of 40 (15" in said[0]
        assert "fleet-wide: past its budget, still sealing" in said[0]
        assert kid in over_budget
    finally:
        over_budget.discard(kid)


def test_a_process_that_stops_before_it_seals_gives_its_reservation_back(fleet: Any) -> None:
    """A process that reserved ahead (at start) and stopped without sealing: its final round writes 0, so the
    settled row holds nothing it never sealed (a port-taken restart does this)."""
    keystore, store = fleet
    codec = LocalAESGCMCodec(keystore, audience=AUD)
    reporter = _reporter(store, codec)
    assert _totals(store, codec)[codec.ring.primary.kid].seals == MIN_BLOCK
    reporter.stop()
    t = _totals(store, codec)[codec.ring.primary.kid]
    assert (t.seals, t.sealed, t.blocks) == (0, 0, 0)
