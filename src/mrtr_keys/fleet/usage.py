"""Fleet-wide seal counts per kid that are never below the truth: reservations in the presence store.

Every instance counts its seals, unseals and rejections per kid in memory (`mrtr_keys.codecs.usage`; one C
call a token). Its `UsageReporter`, a background thread beside the presence heartbeat, writes them to the
presence store's ``key_usage`` table (`mrtr_keys.audit.writing.stores.key_usage`), one row a kid and process. For a kid
the instance seals with (the primary, and the key a rotation has begun), the row's ``seals`` is a
**reservation**: the seals counted plus a block reserved ahead, written before the block is used (the reporter
is woken when half of it is gone, `KidTally.mark`, and reserves the next). So a process killed with SIGKILL
leaves at most its last block unused but counted, never a seal uncounted; a block is sized for about
`HORIZON` seconds of the observed rate and is at most 1 % of the key's budget (`mrtr_keys.ring.budgets.block_of`),
so reservations alone never carry a key past a threshold. A kid the process no longer seals with (after a
promote) is written back to its exact count once it stops sealing; a clean stop writes every count exact and
folds the rows into the kid's settled row.

A live process writes its rows again at least every `REFRESH` seconds, unchanged or not, so a quiet one never
looks silent to a settle (which would fold its counts into the settled row while it still reports them: counted
twice once it writes again). After `REFRESH` seconds without a successful round (an outage, a pause) it first
reads its own rows: those another reporter settled meanwhile are already counted, so it reports only what came
after (`_Kid.base`).

The tallies are the process's, so one reporter a store reports them (`reporter_for`: presences of several
names in one process share it), and a reporter that stopped leaves what it reported to the next one of the
process (`_handed`), which counts on from there: a codec closed and opened again is not counted twice.

Limits (docs/rotation.md, "Rotating by use"): seals past the reservation while the store cannot be written (an
outage: sealing never waits for it) are counted in memory and written when it answers again; a process killed
during such an outage loses those. Unseal and rejection counts are written as they stand each round (a kill
loses at most the last round's): over-counting them would hide that a retiring key is idle.

The reporter also reads the fleet-wide totals back each round (`totals`), warns once at `WARN_AT` of a key's
budget and once past it (the kid then joins `mrtr_keys.codecs.usage.over_budget`: its seals carry the audit
reason ``over-budget``; sealing never stops), and says when it last succeeded (`last_success`, `error`).
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mrtr_keys.audit.events import format_ts
from mrtr_keys.audit.writing.stores.key_usage import RUNNING, STOPPED, KidTotals, UsageRow, totals
from mrtr_keys.codecs.usage import NEVER, KidTally, enabled, over_budget, usage_for
from mrtr_keys.errors import AuditError
from mrtr_keys.fleet.usage_view import budget_note
from mrtr_keys.ring.budgets import WARN_AT, block_of, budget_of
from mrtr_keys.ring.model import KeyRing, KeyState

if TYPE_CHECKING:
    from mrtr_keys.audit.writing.stores.base import AuditStore

log = logging.getLogger("mrtr_keys.usage")

DEFAULT_EVERY = 1.0
"""Seconds between two rounds when nothing wakes the reporter sooner."""
HORIZON = 5.0
"""Seconds of the observed seal rate a reservation block covers (then capped at 1 % of the budget)."""
MIN_BLOCK = 10_000
"""Smallest reservation block, in seals (unless 1 % of the budget is smaller). The first block is reserved before
the rate is known, and the next one is written once half of it is spent: half must outlast a store round trip
under load at a busy sidecar's rate (20,000 seals a second: 0.25 s), or a burst at start-up would seal past the
reservation before it is renewed, and a SIGKILL then would lose those seals. (It was 100: 2.5 ms at that rate;
a library codec sealing in a tight loop over PostgreSQL outran it by 2,149 to 12,728 seals.)"""
SETTLE_AFTER = 3600.0
"""Seconds after which the rows of a silent source (a killed process) are folded into the settled row."""
SETTLE_EVERY = 600.0
"""Seconds between two settles of silent sources by one reporter."""
REFRESH = SETTLE_AFTER / 4
"""Seconds after which a row is written again although unchanged, so a live source never looks silent."""

_Counts = tuple[int, int, int, int]
_handed: dict[tuple[str, str, str], _Counts] = {}
"""(store URL, ring_id, kid) -> the counts of this process a stopped reporter left in that store (its `_Kid.base`
plus what it wrote): where the next reporter of the process into that store counts on from."""
_shared: dict[str, tuple[UsageReporter, int]] = {}
"""Store URL -> this process's reporter into it and how many presences use it (`reporter_for`)."""
_shared_lock = threading.Lock()

RingSource = Callable[[], "KeyRing | None"]
"""Returns the ring a codec (or the sidecar) has loaded now, or None once it is gone."""


@dataclass
class _Kid:
    """What the reporter knows of one kid of one ring in this process."""

    reserved: int = 0
    """``seals`` as last written (the store holds this for our source)."""
    block: int = 0
    seen: int = 0
    """The seal count at the last round."""
    at: float = field(default_factory=time.monotonic)
    rate: float = 0.0
    """Seals a second, smoothed over the rounds."""
    written: tuple[int, int, int, int] | None = None
    """(seals, sealed, unseals, rejections) as last written (what the store holds for our source)."""
    written_at: float = 0.0
    """`UsageReporter` clock time of that write."""
    base: _Counts = (0, 0, 0, 0)
    """The counts of ours that a settle folded into the settled row while we lived: our row holds the rest."""


class UsageReporter:
    """Writes this process's counts of the rings it watches into `store` (see the module docstring).

    Args:
        store: the presence (audit) store.
        instance: the instance name (`mrtr_keys.fleet.instances.instance_name`); the source is
            ``NAME#RANDOM``, one per process.
        every: seconds between rounds.
        clock: POSIX time source for ``updated`` (tests inject one).
    """

    def __init__(
        self, store: AuditStore, *, instance: str, every: float = DEFAULT_EVERY, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.instance = instance
        self.source = f"{instance}#{secrets.token_hex(4)}"
        self.every = every
        self._clock = clock
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._sources: list[RingSource] = []
        self._kids: dict[tuple[str, str], _Kid] = {}
        self._warned: set[tuple[str, str, str]] = set()
        self._listening: set[str] = set()
        self._settled_at = 0.0
        self._thread: threading.Thread | None = None
        self.stopped = False
        self.totals: dict[str, dict[str, KidTotals]] = {}
        """ring_id -> kid -> fleet-wide `KidTotals`, as last read."""
        self.last_success: float | None = None
        """POSIX time of the last round that wrote and read the store."""
        self.error: str | None = None

    def __repr__(self) -> str:
        return f"UsageReporter({self.source!r}, store={self.store.url!r})"

    def watch(self, source: RingSource) -> None:
        """Report on the ring `source` returns too, and run a round now (synchronously, bounded by the store's
        deadline), so the primary holds a reservation before the first token is sealed. Nothing with counting
        off (`mrtr_keys.codecs.usage.ENV_SEAL_COUNTS`)."""
        if not enabled():
            return
        with self._lock:
            self._sources.append(source)
        self.run_round()

    def start(self) -> UsageReporter:
        """Start the background thread (daemon). Returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"mrtr-keys-usage-{self.instance}", daemon=True)
            self._thread.start()
        return self

    def wake(self) -> None:
        """Run a round soon (a tally reached its mark); never blocks."""
        self._wake.set()

    def _run(self) -> None:
        while not self.stopped:
            self._wake.wait(self.every)
            self._wake.clear()
            if self.stopped:
                return
            try:
                self.run_round()
            except Exception:  # the loop must survive anything; the next round tries again
                log.exception("seal count round failed")

    def rings(self) -> list[KeyRing]:
        """The rings watched now (one per ``ring_id``: the newest generation any source has loaded)."""
        found: dict[str, KeyRing] = {}
        with self._lock:
            alive = []
            for source in self._sources:
                ring = source()
                if ring is None:
                    continue
                alive.append(source)
                old = found.get(ring.ring_id)
                if old is None or ring.generation > old.generation:
                    found[ring.ring_id] = ring
            self._sources = alive
        return list(found.values())

    def run_round(self, *, final: bool = False) -> bool:
        """Write what changed (reserving ahead for the kids this process seals with; `final`: every count exact,
        state ``stopped``) and read the totals back. False if the store could not be written or read (logged
        once per message; the next round tries again)."""
        with self._lock:
            rings = self.rings()
            settle = not final and time.monotonic() - self._settled_at >= SETTLE_EVERY
            away = self.last_success is not None and self._clock() - self.last_success >= REFRESH
            try:
                for ring in rings:
                    if away:
                        self._rebase(ring)
                    self._round(ring, final=final)
                    if final:
                        self.store.settle_usage(ring.ring_id, source=self.source)
                    elif settle:
                        self.store.settle_usage(ring.ring_id, before=format_ts(self._clock() - SETTLE_AFTER))
                if settle:
                    self._settled_at = time.monotonic()
            except Exception as exc:  # AuditError, or a store closed under us
                self._failed(exc)
                return False
            if self.error is not None:
                log.warning("seal counts written again (instance %s)", self.instance)
            self.error = None
            self.last_success = self._clock()
            return True

    def _round(self, ring: KeyRing, *, final: bool) -> None:
        usage = usage_for(ring.ring_id)
        if ring.ring_id not in self._listening:
            self._listening.add(ring.ring_id)
            usage.listen(self.wake)
        sealers = _sealers(ring)
        clock = self._clock()
        now, mono = format_ts(clock), time.monotonic()
        rows: list[UsageRow] = []
        marks: list[tuple[KidTally, int]] = []
        for tally in usage.tallies():
            kid = tally.kid
            st = self._kids.get((ring.ring_id, kid))
            if st is None:  # counted on from what an earlier reporter of this process left in this store
                st = self._kids[(ring.ring_id, kid)] = _Kid(
                    base=_handed.get((self.store.url, ring.ring_id, kid), _NONE)
                )
            sealed, unseals, rejections = tally.seals, tally.unseals, tally.rejections
            key = ring.lookup(kid)
            if mono > st.at:
                now_rate = (sealed - st.seen) / (mono - st.at)
                st.rate = now_rate if st.rate == 0.0 else 0.5 * st.rate + 0.5 * now_rate
            quiet = sealed == st.seen
            st.seen, st.at = sealed, mono
            seals, block, mark = sealed, 0, NEVER
            if key is not None and kid in sealers and not final:
                cap = block_of(budget_of(ring, key))
                want = min(cap, max(MIN_BLOCK, math.ceil(st.rate * HORIZON)))
                # under half a block left (or past it): the next block; more left than 1 % of the budget (lowered
                # since): cut back, so reservations never carry a key past a threshold alone
                if sealed + want // 2 >= st.reserved or st.reserved - sealed > cap:
                    seals, block = sealed + want, want
                else:
                    seals, block = st.reserved, st.block
                mark = seals - block // 2 + 1
            elif not final and not quiet:  # no longer a sealer but still sealing (in flight): keep what it has
                seals = max(st.reserved, sealed)
            b_seals, b_sealed, b_unseals, b_rejections = st.base  # what the settled row already holds of ours
            part = (
                max(seals - b_seals, sealed - b_sealed),
                sealed - b_sealed,
                unseals - b_unseals,
                rejections - b_rejections,
            )
            stale = st.written is not None and clock - st.written_at >= REFRESH  # unchanged, but must not look silent
            if (part != st.written or stale) and (st.written is not None or any(part)):  # write, correct or refresh
                rows.append(
                    UsageRow(
                        ring.ring_id,
                        kid,
                        self.source,
                        self.instance,
                        *part,
                        part[0] - part[1],
                        now,
                        STOPPED if final else RUNNING,
                    )
                )
            marks.append((tally, mark))
            st.block = block
        try:
            self.store.put_usage(rows)
        except Exception:
            for tally, _ in marks:
                tally.mark = NEVER  # no wake storm while the store is down: the next round tries again
            raise
        for row in rows:
            st = self._kids[(ring.ring_id, row.kid)]
            st.reserved = row.seals + st.base[0]
            st.written, st.written_at = (row.seals, row.sealed, row.unseals, row.rejections), clock
        for tally, mark in marks:
            tally.mark = mark
        self.totals[ring.ring_id] = totals(self.store.usage_rows(ring.ring_id))
        self._judge(ring)

    def _rebase(self, ring: KeyRing) -> None:
        """After `REFRESH` seconds without a successful round: a row of ours that is gone was settled by another
        reporter meanwhile, its counts folded into the settled row; count on from them (`_Kid.base`)."""
        ours = {r.kid for r in self.store.usage_rows(ring.ring_id) if r.source == self.source}
        for (ring_id, kid), st in self._kids.items():
            if ring_id == ring.ring_id and st.written is not None and kid not in ours:
                st.base = tuple(b + w for b, w in zip(st.base, st.written, strict=True))  # type: ignore[assignment]
                st.written = None

    def _judge(self, ring: KeyRing) -> None:
        """Warn once at `WARN_AT` of a usable key's budget and once past it; keep `over_budget` current."""
        found = self.totals.get(ring.ring_id, {})
        for key in ring.keys:
            t = found.get(key.kid)
            if t is None:
                continue
            budget = budget_of(ring, key)
            fraction = t.seals / budget
            if fraction >= 1.0:
                over_budget.add(key.kid)
            else:
                over_budget.discard(key.kid)
            if key.state is KeyState.RETIRED or key.state is KeyState.REVOKED:
                continue
            levels = (("half", WARN_AT), ("over", 1.0))
            crossed = {(ring.ring_id, key.kid, level) for level, at in levels if fraction >= at}
            if crossed - self._warned:  # one line for a key found past both thresholds in one round
                self._warned |= crossed
                log.warning("%s", budget_note(key.kid, t.seals, budget))

    def _failed(self, exc: BaseException) -> None:
        if not isinstance(exc, AuditError | OSError):
            exc = AuditError(f"{type(exc).__name__}: {exc}")
        if str(exc) != self.error:
            log.warning("seal counts not written (instance %s): %s", self.instance, exc)
        self.error = str(exc)

    def stop(self) -> None:
        """Write every count exact (state ``stopped``), fold this process's rows into the settled ones, and end
        the thread (once)."""
        with self._lock:
            if self.stopped:
                return
            self.stopped = True
            self._wake.set()
            self.run_round(final=True)
            for (ring_id, kid), st in self._kids.items():  # what the store holds of ours, for the next reporter
                if st.written is not None:
                    counts = tuple(b + w for b, w in zip(st.base, st.written, strict=True))
                    _handed[(self.store.url, ring_id, kid)] = counts  # type: ignore[assignment]
            for ring_id in self._listening:
                usage_for(ring_id).unlisten(self.wake)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(3.0)


_NONE: _Counts = (0, 0, 0, 0)


def reporter_for(store: AuditStore, *, instance: str) -> UsageReporter:
    """This process's (started) reporter into `store`, shared by every presence that asks (one more user each
    call; `release` when done): two reporters of one process would each report its tallies."""
    with _shared_lock:
        reporter, users = _shared.get(store.url, (None, 0))
        if reporter is None or reporter.stopped:
            reporter, users = UsageReporter(store, instance=instance), 0
        _shared[store.url] = (reporter, users + 1)
    if enabled():
        reporter.start()
    return reporter


def release(reporter: UsageReporter) -> None:
    """One user of `reporter_for`'s reporter fewer; the last one stops it (its final counts)."""
    with _shared_lock:
        current, users = _shared.get(reporter.store.url, (None, 0))
        if current is reporter:
            if users > 1:
                _shared[reporter.store.url] = (reporter, users - 1)
                return
            del _shared[reporter.store.url]
    reporter.stop()


def _sealers(ring: KeyRing) -> set[str]:
    """The kids a process may seal with: the primary, and a key a rotation has begun (promote makes it the
    primary, and its reservation is then already in place)."""
    begun = {k.kid for k in ring.keys if k.state is KeyState.VERIFY and k.demoted_at is None}
    return {ring.primary.kid} | begun
