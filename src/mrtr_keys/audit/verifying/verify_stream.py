"""Streaming ``audit verify``: every chain walked from raw rows read in bounded pages, from genesis,
from a prune's cut, or from a checkpoint forward.

Findings: deleted, altered, inserted, reordered, truncated (`mrtr_keys.audit.writing.chain`), keyed links
checked with the chain keys (`mrtr_keys.audit.writing.chain_key`), checkpointed heads present and unchanged;
memory bounded by one page of rows plus,
per chain, its open batch (a batch is one writer transaction, at most 2 000 events for the
product's writers; a longer one is hashed incrementally past `MAX_PENDING` rows) and a few
numbers. Nothing grows with the log: a gap in a chain is classified (``deleted``, or
``reordered`` if a missing seq turns up later in the walk) when the walk ends, not by holding
every seq.

Where a chain starts:

* **genesis** (seq 1, ``prev_hash`` 64 zeros) by default;
* **a prune's cut** (`mrtr_keys.audit.retention.prune`): a checkpoint document with ``"kind": "prune"``
  records, for every chain it cut, the last pruned record (seq, batch hash, time). The chain then
  starts after it: the first kept batch must link to that hash and follow that seq, so a deletion
  that is not a prune (a gap after the cut), an edit, an insertion or a reordering among the kept
  events is caught as before. A record at or before the cut still in the store is reported as
  ``inserted`` (it was put back, or a prune was interrupted: run it again);
* **a checkpoint** (``--since``): its recorded heads are the trusted start; the walk begins at the
  storage position of the oldest of them (found through the time index), and records at or before
  a chain's start are not checked (the run makes no claim about them).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mrtr_keys.audit.verifying import verify_parallel
from mrtr_keys.audit.verifying.verify_runs import MAX_PENDING, RunWalk
from mrtr_keys.audit.writing.chain import GENESIS, Break, VerifyReport, checkpoint_break, hash_values
from mrtr_keys.audit.writing.chain_key import PREFIX, ChainKeys, is_keyed, key_id_of

PAGE = 20_000
"""Rows read per page (keyset on the storage position)."""

_EMPTY = ("", "")
Progress = Callable[[int, float], None]
"""``progress(records_read, seconds_elapsed)``, called about once a page."""


@dataclass(frozen=True)
class Start:
    """Where one chain's walk starts: after record `seq`, whose batch hash is `hash`."""

    writer: str
    seq: int
    hash: str
    time: str | None
    source: str  # "prune" or "checkpoint"


@dataclass
class StreamReport(VerifyReport):
    """`VerifyReport` plus where the walk started and how fast it ran."""

    since: str | None = None
    """The time of the checkpoint the walk started from (``--since``), or None (from genesis)."""
    pruned_before: str | None = None
    """The newest prune's cut-off time, if the store was pruned."""
    seconds: float = 0.0
    writers: set[str] = field(default_factory=set)
    """The chains the walk found records of (`mrtr_keys.audit.verifying.store_match.id_break`; not in `to_json`)."""
    keyed: int = 0
    """Records verified in batches with keyed links (chain version 2, `mrtr_keys.audit.writing.chain_key`)."""
    unkeyed: int = 0
    """Records verified in batches with SHA-256 links (written before the store's switch to keyed links)."""
    switch: dict[str, Any] | None = None
    """The store's switch to keyed links (`mrtr_keys.audit.writing.switch`), if it records one."""

    def to_json(self) -> dict[str, Any]:
        rate = self.records / self.seconds if self.seconds > 0 else None
        return {
            **super().to_json(),
            "keyed": self.keyed,
            "unkeyed": self.unkeyed,
            "chain_switch": self.switch,
            "since": self.since,
            "pruned_before": self.pruned_before,
            "seconds": round(self.seconds, 3),
            "records_per_second": round(rate) if rate else None,
        }


class _Chain:
    __slots__ = (
        "began",
        "brk",
        "closed",
        "expected",
        "first",
        "gap",
        "hasher",
        "head",
        "keyed",
        "nonlink",
        "pending",
        "pieces",
        "runs",
        "skip_before",
        "start",
        "start_hash",
        "wanted",
        "writer",
    )

    def __init__(self, writer: str, start: Start | None, skip_before: bool) -> None:
        self.writer = writer
        self.start = start.seq if start else 0
        self.expected = self.start + 1
        self.head = self.start_hash = start.hash if start else GENESIS
        self.closed = self.start  # the seq of the last batch end verified
        self.keyed = is_keyed(self.head)  # from here on, every link must be keyed
        self.began: int | None = None  # the storage position of its first record walked
        self.pending: list[Any] = []  # row tuples (`Walker.feed`) or their repr (`Walker.feed_pieces`)
        self.pieces = 0  # how many of `pending` are repr strings
        self.nonlink = 0  # rows of the open batch without a link, when fed runs (`Walker.feed_runs`)
        self.runs: list[tuple[int, int, int]] = []  # (first position, last position, first seq) of its runs
        self.first: Sequence[Any] = ()
        self.hasher: _Spilled | None = None
        self.brk: list[Any] | None = None  # [kind, position, seq, time, detail]
        self.gap: tuple[int, int] | None = None  # missing seqs [lo, hi) awaiting classification
        self.skip_before = skip_before
        self.wanted: dict[int, str | None] = {}


@dataclass
class Walker(RunWalk):
    """Feed pages of raw rows (position, then `SQL_COLUMNS`) in storage order; `finish` reports."""

    starts: dict[str, Start] = field(default_factory=dict)
    skip_before_start: bool = False
    """True for ``--since``: records at or before a chain's start are not checked."""
    report: StreamReport = field(default_factory=StreamReport)
    cut_before: str | None = None
    """If set, `cuts` keeps each chain's newest verified batch end with an event time before this
    (what ``audit prune`` cuts at)."""
    cuts: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    """writer -> (seq, hash, time) of that batch end."""
    keys: ChainKeys | None = None
    """The chain keys keyed links are checked with (None: a keyed link cannot be verified, a break)."""
    switch_at: int | None = None
    """The storage position of the store's switch to keyed links (`mrtr_keys.audit.writing.switch`): a chain
    that begins after it must be keyed from its first batch. None: no switch recorded."""
    _chains: dict[str, _Chain] = field(default_factory=dict)
    _by_raw: dict[int, _Chain] = field(default_factory=dict)  # a name id -> its chain (`feed_runs`)
    _view: Any = None

    def chain(self, writer: str) -> _Chain:
        c = self._chains.get(writer)
        if c is None:
            c = self._chains[writer] = _Chain(writer, self.starts.get(writer), self.skip_before_start)
        return c

    def feed(self, rows: Sequence[tuple[Any, ...]]) -> None:
        chains = self._chains
        empty = _EMPTY
        for row in rows:
            writer = row[12]
            c = chains.get(writer)
            if c is None:
                c = self.chain(writer)
                if c.began is None:
                    c.began = row[0]
            seq = row[13]
            if c.brk is not None:
                gap = c.gap
                if gap is not None and gap[0] <= seq < gap[1]:
                    c.brk[0], c.brk[4] = "reordered", f"record seq {c.brk[2]} is stored before seq {gap[0]}"
                    c.gap = None
                continue
            if seq != c.expected:
                self._out_of_order(c, row)
                continue
            c.expected = seq + 1
            pending = c.pending
            if not pending:
                c.first = row
            link = row[15]
            if link:
                pending.append(row[1:14] + empty)
                self._close(c, row)
            else:
                pending.append(row[1:])
                if len(pending) >= MAX_PENDING:
                    self._spill(c)
        self.report.records += len(rows)

    @staticmethod
    def _text(c: _Chain) -> str:
        """``repr`` of the open batch's rows (`pending`, tuples and pieces)."""
        if not c.pieces:
            return repr(c.pending)
        if c.pieces == len(c.pending):
            return "[" + ", ".join(c.pending) + "]"
        return "[" + ", ".join([p if p.__class__ is str else repr(p) for p in c.pending]) + "]"

    def _spill(self, c: _Chain) -> None:
        """Hash the open batch's rows so far incrementally (seeded with the chain's head)."""
        self._began(c)
        text = self._text(c)[1:-1]
        if c.hasher is None:
            c.hasher = _Spilled(c.head + "[", self.keys)
        else:
            text = ", " + text
        c.hasher.update(text.encode("utf-8", "surrogatepass"))
        c.pending = []
        c.pieces = 0

    def _began(self, c: _Chain) -> None:
        if c.began is None:  # a chain made by `expect_head` before its first record
            c.began = c.runs[0][0] if c.runs else c.first[0]

    def _close(self, c: _Chain, row: tuple[Any, ...]) -> None:
        """The batch's last record (`row`) carries its link: check content, then the link."""
        prev, link, seq = row[14], row[15], row[13]
        n = c.nonlink + 1 if c.runs else len(c.pending)  # rows in the batch (unless spilled)
        self._began(c)
        keyed = is_keyed(link)
        problem = None
        if c.hasher is not None or c.nonlink >= MAX_PENDING:  # a long batch: hashed from the expected head
            if c.hasher is None:  # fed as runs, not spilled yet: as if it had been
                c.hasher = _Spilled(c.head, self.keys)
                c.hasher.update(self._text(c).encode("utf-8", "surrogatepass"))
            else:
                c.hasher.update((", " + self._text(c)[1:]).encode("utf-8", "surrogatepass"))
            if prev != c.head:
                problem = "inserted", f"the batch ending at seq {seq} does not link to the batch before it"
            else:
                problem = self._link_problem(c, c.hasher.link(link), link, keyed, seq, n)
            c.hasher = None
        else:
            if keyed:
                key = self.keys.of_link(link) if self.keys is not None else None
                digest = None if key is None else key.link(prev, self._text(c))
            else:
                digest = hashlib.sha256((prev + self._text(c)).encode("utf-8", "surrogatepass")).hexdigest()
                if digest != link and n == 1 and hash_values(prev, c.writer, seq, row[1:12]) == link:
                    digest = link  # a record of a store written before batch chaining: a link each
            problem = self._link_problem(c, digest, link, keyed, seq, n)
            if problem is None and prev != c.head:
                problem = "inserted", f"the batch ending at seq {seq} does not link to the batch before it"
        first = self._first(c, n) if problem is not None else None
        c.pending, c.runs = [], []
        c.pieces = c.nonlink = 0
        if problem is not None and first is not None:
            c.brk = [problem[0], first[0], first[13], first[1], problem[1]]
            return
        if keyed:
            self.report.keyed += seq - c.closed
            c.keyed = True
        else:
            self.report.unkeyed += seq - c.closed
        c.closed = seq
        c.head = link
        if self.cut_before is not None and row[1] < self.cut_before:
            self.cuts[c.writer] = (seq, link, row[1])
        if c.wanted and seq in c.wanted:
            c.wanted[seq] = link

    def _link_problem(
        self, c: _Chain, digest: str | None, link: str, keyed: bool, seq: int, n: int
    ) -> tuple[str, str] | None:
        """What is wrong with a batch's link given what its rows give (`digest`; None: no key for it)."""
        switch = self.switch_at
        if digest is None:
            why = (
                f"their batch is linked under chain key id {key_id_of(link)!r}, which this verifier does not hold "
                "(a store written under another audit key; if it is a retired key of this fleet, name its file in "
                "MRTR_KEYS_AUDIT_OLD_KEY_FILES)"
            )
        elif digest != link:
            why = "their fields do not match their batch's hash"
        elif keyed:
            return None
        elif c.keyed:
            why = "an unkeyed link after this chain's keyed ones (a rewrite without the chain key)"
        elif switch is not None and (c.began or 0) > switch and not (c.start and not is_keyed(c.start_hash)):
            why = (
                f"an unkeyed link in a chain that began after the store's switch to keyed links (position "
                f"{switch}): written without the chain key"
            )
        else:
            return None
        span = f"seq {self._first(c, n)[13]}..{seq}" if n > 1 else f"seq {seq}"
        return "altered", f"records {span}: {why}"

    def _out_of_order(self, c: _Chain, row: tuple[Any, ...]) -> None:
        seq = row[13]
        if seq < c.expected:
            if seq <= c.start:
                if c.skip_before:
                    self.report.records -= 1  # before the trusted start of a --since run: not checked
                    return
                detail = (
                    f"record seq {seq} is at or before the chain's prune cut (seq {c.start}): "
                    "it was put back after the prune, or a prune was interrupted (run audit prune again)"
                )
            else:
                detail = f"record seq {seq} appears twice"
            c.brk = ["inserted", row[0], seq, row[1], detail]
            return
        lo = c.expected
        c.gap = (lo, seq)
        what = f"record seq {lo} is missing" if seq - lo == 1 else f"records seq {lo}..{seq - 1} are missing"
        if lo == c.start + 1 and c.start:
            what += f" (after the chain's trusted start at seq {c.start}; not removed by a prune)"
        hint = "; if a prune cut them, it recorded that in another checkpoint file: --checkpoints" if lo == 1 else ""
        c.brk = ["deleted", row[0], seq, row[1], f"{what} (before seq {seq}{hint})"]

    def broken(self) -> list[Break]:
        """The breaks found so far (chains whose walk stopped), without closing the walk."""
        chains = [c for c in self._chains.values() if c.brk]
        return [Break(c.brk[0], c.writer, c.brk[1], c.brk[2], c.brk[3], c.brk[4]) for c in chains]  # type: ignore[index]

    def start_of(self, writer: str) -> int:
        """The seq a chain's walk started after (0: genesis)."""
        start = self.starts.get(writer)
        return start.seq if start else 0

    def expect_head(self, writer: str, seq: int) -> None:
        """Remember the hash of record `seq` of `writer` if it is reached (a checkpointed head)."""
        self.chain(writer).wanted.setdefault(seq, None)

    def finish(self, heads: Iterable[tuple[dict[str, Any], dict[str, Any]]] = ()) -> StreamReport:
        """Close every chain; check `heads` ((checkpoint document, head) pairs) against the walk."""
        report = self.report
        for c in self._chains.values():
            if c.brk is not None:
                report.breaks.append(Break(c.brk[0], c.writer, c.brk[1], c.brk[2], c.brk[3], c.brk[4]))
            elif c.pending or c.hasher is not None:
                first, end = self._first(c, c.nonlink) if c.runs else c.first, c.expected - 1
                detail = (
                    f"records seq {first[13]}..{end} end without their batch's hash: its last records "
                    "were deleted, or these were added"
                )
                report.breaks.append(Break("truncated", c.writer, first[0], first[13], first[1], detail))
                c.brk = ["truncated"]
        report.writers = {c.writer for c in self._chains.values() if c.expected > c.start + 1 or c.brk is not None}
        report.chains = len(report.writers)
        for doc, head in heads:
            report.checkpoints_checked += 1
            writer, seq = str(head["writer"]), int(head["seq"])
            found = self._chains.get(writer)
            if found is None or found.brk is not None:
                continue
            c = found
            if seq < c.start:
                continue  # before the chain's start (pruned, or before --since): nothing to compare
            have = c.start_hash if seq == c.start else c.wanted.get(seq)
            found_break = checkpoint_break(doc, head, have, last=c.expected - 1)
            if found_break is not None:
                report.breaks.append(found_break)
        return report


class _Spilled:
    """The incremental hash of a long batch, as every link it may carry: SHA-256, or the HMAC of each key."""

    __slots__ = ("macs", "sha")

    def __init__(self, seed: str, keys: ChainKeys | None) -> None:
        self.sha = hashlib.sha256(seed.encode("utf-8", "surrogatepass"))
        self.macs = {k.key_id: k.hasher(seed) for k in (keys.all() if keys is not None else ())}

    def update(self, data: bytes) -> None:
        self.sha.update(data)
        for mac in self.macs.values():
            mac.update(data)

    def link(self, link: str) -> str | None:
        """What the rows give for `link`'s kind (None: a keyed link under a key not held)."""
        if not is_keyed(link):
            return self.sha.hexdigest()
        mac = self.macs.get(key_id_of(link))
        return None if mac is None else f"{PREFIX}{key_id_of(link)}:{mac.hexdigest()}"


def walk_pages(
    walker: Walker,
    store: Any,
    after: int,
    page: int,
    progress: Progress | None,
    started: float,
    *,
    runs: bool = True,
    split_min_rows: int = verify_parallel.MIN_ROWS,
) -> None:
    """Feed `walker` every record of `store` after position `after`, `page` at a time: as runs on
    SQLite schema 4 (split across processes from `split_min_rows` positions), else as rows.

    Raises:
        AuditError: the store cannot be read.
    """
    fast = store.run_pages(after, page) if runs and hasattr(store, "run_pages") else None
    if fast is not None:  # SQLite schema 4: raw rows and their hash text (the same walk, less work)
        view, pages = fast
        split = verify_parallel.run_pages(store, after, page, min_rows=split_min_rows)
        if split is not None:  # a large log: rendered by two processes, then what came meanwhile
            pages = itertools.chain(split[1], store.run_pages(split[0], page)[1])
        for page_runs in pages:
            walker.feed_runs(page_runs, view)
            del page_runs
            if progress is not None:
                progress(walker.report.records, time.monotonic() - started)
        return
    for rows in store.row_batches(after, page):
        walker.feed(rows)
        del rows  # not alive while the next page is fetched: one page at a time
        if progress is not None:
            progress(walker.report.records, time.monotonic() - started)
