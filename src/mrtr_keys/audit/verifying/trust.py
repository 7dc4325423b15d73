"""What a walk trusts as each chain's start and head, read from every source outside the store into one `Trust`.

A chain alone cannot show a cut-off tail, and the records before the switch to keyed links can be
rewritten by anyone who recomputes their SHA-256 links. What shows them is a record kept where the store's
writers cannot rewrite it (`mrtr_keys.audit.verifying.ledger`: a file, a directory, ``s3://``). There are three
kinds, and the store itself says one more thing:

* **checkpoints** (``audit checkpoint``): every chain's head at a moment; each must still be in the store,
  with the same link;
* **prune records** (``audit prune``, ``audit archive``, the sidecar's retention): each chain's **cut**,
  where its walk starts (the first kept batch must link to it), and the **archive** (``"archive"``:
  location, manifest name and SHA-256) that holds what was cut (`mrtr_keys.audit.verifying.archive_verify`);
* **anchors** (``serve --audit-anchor``, `mrtr_keys.audit.verifying.anchor`): the heads a running service wrote
  itself, every few minutes; of each instance only its newest anchor is kept (it says all its
  predecessors said, and more);
* the store's **switch** to keyed links (`mrtr_keys.audit.writing.switch`).

Rules, in `gather`: a record belongs to the store by its store id (`mrtr_keys.audit.verifying.store_match`). A
record that carries a MAC must hold under one of the verifier's chain keys, and an anchor must carry one;
otherwise it is a break of kind `CHECKPOINT` (whoever could forge a record could also hide a cut-off
tail or a rewritten chain), and its heads are not used. The newest record that noted the store's switch
must agree with the switch the store holds: a switch record deleted or moved since is a break (kind
``store``). ``--since`` picks a checkpoint whose heads become the chains' starts (`pick_since`).

`verify_store` and `verify_records` are the walk with its trust: `gather`, then `Trust.walker`, the
pages, `Trust.finish`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mrtr_keys.audit.verifying import verify_parallel
from mrtr_keys.audit.verifying.ledger import ANCHOR, ARCHIVE, PRUNE
from mrtr_keys.audit.verifying.store_match import Matched, checkpoints_of
from mrtr_keys.audit.verifying.verify_stream import PAGE, Progress, Start, StreamReport, Walker, walk_pages
from mrtr_keys.audit.writing import switch
from mrtr_keys.audit.writing.chain import Break, Record
from mrtr_keys.audit.writing.chain_key import MAC, ChainKeys
from mrtr_keys.audit.writing.stores.base import record_row
from mrtr_keys.errors import ConfigError

CHECKPOINT = "checkpoint"
"""`Break.kind` of a trusted record that does not hold (its MAC), as opposed to the records of the store."""


@dataclass
class Trust:
    """Every chain's trusted start and the heads to find, for one walk of one store (see the module docstring)."""

    docs: list[dict[str, Any]]
    """The store's records, in the order read (source after source), those that did not hold included."""
    matched: Matched
    keys: ChainKeys | None
    switch: switch.Switch | None = None
    has_meta: bool = False
    starts: dict[str, Start] = field(default_factory=dict)
    pruned_before: str | None = None
    heads: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    """(record, head) pairs: each head must be in the store with its link."""
    breaks: list[Break] = field(default_factory=list)
    """What the trusted records themselves say is wrong (a MAC that does not hold, a switch moved)."""
    since: str | None = None
    """The time of the checkpoint ``--since`` picked (its heads are the starts)."""
    after: int = 0
    """The storage position the walk starts after."""
    missing: list[tuple[str, int, Any]] = field(default_factory=list)
    """(writer, seq, time) of the picked checkpoint's heads that are not in the store."""

    @property
    def archives(self) -> list[dict[str, Any]]:
        """The archive references of the prune records (``location``, ``manifest``, ``sha256``), oldest first."""
        return [d[ARCHIVE] for d in self.docs if d.get("kind") == PRUNE and isinstance(d.get(ARCHIVE), dict)]

    def cut_at(self, writer: str, seq: int) -> Start | None:
        """The prune cut of `writer` at `seq`, if a prune record holds one."""
        for doc in self.docs:
            if doc.get("kind") == PRUNE:
                for cut in [*doc.get("cuts", []), *doc.get("carried", [])]:
                    if str(cut["writer"]) == writer and int(cut["seq"]) == seq:
                        return Start(writer, seq, str(cut["hash"]), cut.get("time"), PRUNE)
        return None

    def walker(self, *, heads: bool = True, skip_before_start: bool | None = None, **kw: Any) -> Walker:
        """A `Walker` that starts each chain where this trust says and (`heads`) will look for its heads;
        `skip_before_start`: records at or before a chain's start are not checked (default: with ``--since``);
        `kw`: other `Walker` fields."""
        skip = self.since is not None if skip_before_start is None else skip_before_start
        walker = Walker(starts=dict(self.starts), skip_before_start=skip, keys=self.keys, **kw)
        walker.report.pruned_before, walker.report.since = self.pruned_before, self.since
        if self.switch is not None:
            walker.switch_at, walker.report.switch = self.switch.position, self.switch.to_json()
        for writer, seq, when in self.missing:
            detail = f"the head of the checkpoint --since picked (seq {seq}) is not in the store as recorded"
            walker.chain(writer).brk = ["truncated", 0, seq, when, detail]
        for _, head in self.heads if heads else ():
            walker.expect_head(str(head["writer"]), int(head["seq"]))
        return walker

    def finish(self, walker: Walker) -> StreamReport:
        """Close the walk: the heads checked, then what the trusted records and the switch say (`problems`)."""
        report = walker.finish(self.heads)
        report.breaks.extend(self.problems(report.keyed))
        return report

    def problems(self, keyed: int) -> list[Break]:
        """What the trusted records and the store's switch say is wrong, after a walk that verified `keyed`
        records with keyed links: `breaks`, a switch record that does not hold, or none in a store that
        keeps ``store_meta`` while keyed links are there (every keyed writer records it first: deleted)."""
        out = list(self.breaks)
        if self.switch is not None and self.switch.problem is not None:
            out.append(Break(switch.STORE, "", 0, 0, None, self.switch.problem))
        elif self.switch is None and keyed and self.has_meta and self.keys is not None:
            detail = (
                f"the store holds keyed links but no {switch.NAME} record in store_meta (every keyed writer "
                "records it first): it was deleted, so that chains without the key would pass"
            )
            out.append(Break(switch.STORE, "", 0, 0, None, detail))
        return out


def gather(store: Any, docs: Iterable[dict[str, Any]], *, keys: ChainKeys | None, since: str | None = None) -> Trust:
    """The trust of one walk of `store` from the records `docs` (every source's, in the order read): see
    the module docstring. `since`: an event time string or ``last`` (`pick_since`).

    Raises:
        ConfigError: `since` names no checkpoint; AuditError: the store cannot be read.
    """
    matched = checkpoints_of(docs, store)
    trust = Trust(docs=matched.docs, matched=matched, keys=keys, has_meta=switch.has_meta(store))
    if keys is not None:
        trust.switch = switch.read(store, keys)
    held = _held(trust)
    usable = [d for d in held if d.get("kind") != ANCHOR]
    anchors = _newest_anchors([d for d in held if d.get("kind") == ANCHOR])
    trust.starts, trust.pruned_before = prune_starts(usable)
    _check_switch(trust, [*usable, *anchors])
    heads_docs = [d for d in usable if d.get("kind") != PRUNE] + anchors
    if since is not None:
        doc = pick_since(usable, since)
        trust.since = str(doc["time"])
        trust.after = _since_start(trust, store, doc)
        heads_docs = [d for d in heads_docs if str(d.get("time")) >= str(doc["time"])]
    trust.heads = [(d, h) for d in heads_docs for h in d.get("heads", [])]
    return trust


def _held(trust: Trust) -> list[dict[str, Any]]:
    """The records whose MAC holds (or that carry none and need none); a break in `trust` for each other one."""
    held = []
    for doc in trust.docs:
        problem = _mac_problem(doc, trust.keys)
        if problem is None:
            held.append(doc)
            continue
        what = "anchor" if doc.get("kind") == ANCHOR else f"{doc.get('kind') or 'checkpoint'} record"
        detail = f"the {what} of {doc.get('time')} cannot be trusted: {problem}"
        trust.breaks.append(Break(CHECKPOINT, "", 0, 0, doc.get("time"), detail))
    return held


def _mac_problem(doc: dict[str, Any], keys: ChainKeys | None) -> str | None:
    if MAC not in doc:
        anchor = doc.get("kind") == ANCHOR
        return "it carries no MAC (an anchor always does: it was written without the chain key)" if anchor else None
    return None if keys is None else keys.doc_problem(doc)


def _newest_anchors(anchors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    newest: dict[str, dict[str, Any]] = {}
    for doc in anchors:
        who = str(doc.get("instance"))
        if who not in newest or str(doc.get("time")) >= str(newest[who].get("time")):
            newest[who] = doc
    return list(newest.values())


def _check_switch(trust: Trust, docs: list[dict[str, Any]]) -> None:
    """The newest record that noted the store's switch must agree with the store's switch record."""
    noted = [d for d in docs if isinstance(d.get(switch.NAME), dict)]
    if not noted or trust.keys is None:
        return
    newest = max(noted, key=lambda d: str(d.get("time")))
    want, have = newest[switch.NAME], trust.switch
    if have is None or (have.position, have.key_id) != (want.get("position"), want.get("key_id")):
        now = "none" if have is None else f"position {have.position}, key id {have.key_id}"
        detail = (
            f"the store's switch to keyed links is not the one the record of {newest.get('time')} saw (position "
            f"{want.get('position')}, key id {want.get('key_id')}; the store has {now}): its switch record was "
            "deleted or rewritten"
        )
        trust.breaks.append(Break(switch.STORE, "", 0, 0, newest.get("time"), detail))


def _since_start(trust: Trust, store: Any, doc: dict[str, Any]) -> int:
    """Make the heads of checkpoint `doc` the chains' starts (a prune's later cut wins); the position to read after."""
    starts = trust.starts
    positions: list[int] = []
    for cut in doc.get("cuts", []):  # a prune's cuts: deleted rows, nothing to look up
        writer, seq = str(cut["writer"]), int(cut["seq"])
        if writer not in starts or starts[writer].seq < seq:
            starts[writer] = Start(writer, seq, str(cut["hash"]), cut.get("time"), PRUNE)
    for head in doc.get("heads", []):
        writer, seq = str(head["writer"]), int(head["seq"])
        if writer in starts and starts[writer].seq >= seq:
            continue  # pruned since: the prune's cut is the later start
        starts[writer] = Start(writer, seq, str(head["hash"]), head.get("time"), "checkpoint")
        found = store.position_of(writer, seq, str(head.get("time")))
        if found is None:
            trust.missing.append((writer, seq, head.get("time")))
        else:
            positions.append(found)
    return min(positions) - 1 if positions else 0


def prune_starts(docs: Iterable[dict[str, Any]]) -> tuple[dict[str, Start], str | None]:
    """Every chain's cut from the prune records in `docs` (the highest seq per chain; ``cuts``, and
    ``carried``: earlier cuts a prune recorded again under the store id, `mrtr_keys.audit.retention.prune`),
    and the newest prune's ``before`` time."""
    starts: dict[str, Start] = {}
    before: str | None = None
    for doc in docs:
        if doc.get("kind") != PRUNE:
            continue
        before = max(before or "", str(doc.get("before") or "")) or None
        for cut in [*doc.get("cuts", []), *doc.get("carried", [])]:
            writer, seq = str(cut["writer"]), int(cut["seq"])
            if writer not in starts or seq > starts[writer].seq:
                starts[writer] = Start(writer, seq, str(cut["hash"]), cut.get("time"), PRUNE)
    return starts, before


def pick_since(docs: Sequence[dict[str, Any]], since: str) -> dict[str, Any]:
    """The checkpoint to start from: the newest one written at or before `since` (an event time
    string), or the newest of all for ``last`` (``audit checkpoint`` records; a prune's cuts
    are the start of the chains it cut in any case; anchors are not starts).

    Raises:
        ConfigError: no checkpoint qualifies.
    """
    dated = [
        d for d in docs if isinstance(d.get("time"), str) and d.get("kind") not in (PRUNE, ANCHOR) and d.get("heads")
    ]
    if since != "last":
        dated = [d for d in dated if d["time"] <= since]
    if not dated:
        raise ConfigError(
            f"no checkpoint {'' if since == 'last' else f'at or before {since} '}for this store: "
            "run `mrtr-keys audit checkpoint` first (or verify without --since)"
        )
    return max(dated, key=lambda d: d["time"])


def verify_store(
    store: Any,
    docs: Sequence[dict[str, Any]],
    *,
    since: str | None = None,
    progress: Progress | None = None,
    page: int = PAGE,
    runs: bool = True,
    split_min_rows: int = verify_parallel.MIN_ROWS,
    keys: ChainKeys | None = None,
) -> StreamReport:
    """Walk every chain of `store` (an `AuditStore`) in bounded pages with the trust of the records `docs`
    (every source's, file order; those of other stores are not applied) and the chain keys `keys` (None: a
    keyed link is a break). `since`: an event time string or ``last``: start from that checkpoint
    (`pick_since`) instead of genesis. `runs` False: the row walk even where runs apply (SQLite schema 4;
    the reference the run walk is tested against); `split_min_rows`: positions from which the rendering
    is split across processes (`verify_parallel`).

    Raises:
        ConfigError: `since` names no checkpoint; AuditError: the store cannot be read.
    """
    started = time.monotonic()
    trust = gather(store, docs, keys=keys, since=since)
    walker = trust.walker()
    walk_pages(walker, store, trust.after, page, progress, started, runs=runs, split_min_rows=split_min_rows)
    report = trust.finish(walker)
    report.seconds = time.monotonic() - started
    return report


def verify_records(
    records: Iterable[Record], checkpoints: Iterable[dict[str, Any]] = (), *, keys: ChainKeys | None = None
) -> StreamReport:
    """`verify_store`'s walk over `records` (`Record` s in storage order, held by the caller) and the
    heads of the records `checkpoints`, with the chain keys `keys`."""
    walker = Walker(keys=keys)
    pairs = [(d, h) for d in checkpoints if d.get("kind") != PRUNE for h in d.get("heads", [])]
    for _, head in pairs:
        walker.expect_head(str(head["writer"]), int(head["seq"]))
    walker.feed([(r.position or i, *record_row(r)) for i, r in enumerate(records, 1)])
    return walker.finish(pairs)
