"""Tamper evidence: each writer's records form a hash chain of batches; `verify` walks them; checkpoints pin heads.

Every record carries ``writer`` (one chain per writing process and store) and ``seq`` (1, 2, 3, ...
within that writer). The writer links each committed batch (one store transaction) once: the
batch's last record carries ``prev_hash`` (the previous batch's ``hash``; 64 zeros for the first)
and ``hash`` = SHA-256 over ``prev_hash`` and the ``repr`` of the batch's rows in order (every
event field, ``writer`` and ``seq`` of each, with empty ``prev_hash``/``hash``); the batch's other
records carry empty ``prev_hash`` and ``hash``. (Records written before batch chaining carry a
link each, a batch of one hashed as `record_hash`; `verify` reads both.) Walking a store in its
storage order (row id, or line order for JSONL) then shows:

* altered: a batch's records no longer give its ``hash`` (reported at the batch's first record);
* deleted: a writer's ``seq`` skips numbers;
* reordered: a ``seq`` arrives early and the skipped ones turn up later;
* inserted: a record repeats an earlier ``seq``, or a batch does not link to its predecessor;
* truncated: a writer's records end without their batch's hash (the end of a batch deleted, or
  records appended).

What a chain alone cannot show: a cut-off tail (the newest batches of a writer deleted, or a
whole writer's records removed), or a chain rewritten end to end by someone who can recompute
it. The remedy is a checkpoint (`make_checkpoint`, ``mrtr-keys audit checkpoint``): the head
(last seq and hash) of every chain, written to a place the store's writers cannot rewrite (a
file owned by another account, an append-only or object-locked bucket, a ticket); ``verify``
then checks that each checkpointed head is still in the store, unchanged. See docs/audit.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrtr_keys.audit.events import AuditEvent, format_ts
from mrtr_keys.audit.row_repr import rows_repr
from mrtr_keys.errors import ConfigError

GENESIS = "0" * 64
"""`prev_hash` of a writer's first record."""

CHAIN_FIELDS = ("writer", "seq", "prev_hash", "hash")


@dataclass(frozen=True, slots=True)
class Record:
    """An event as stored: the event, its chain fields, and `position` (1-based storage order)."""

    event: AuditEvent
    writer: str
    seq: int
    prev_hash: str
    hash: str
    position: int = 0

    def to_json(self) -> dict[str, Any]:
        """The event fields then the chain fields (the JSONL store and ``export`` line format)."""
        return {
            **self.event.to_json(),
            "writer": self.writer,
            "seq": self.seq,
            "prev_hash": self.prev_hash,
            "hash": self.hash,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any], position: int = 0) -> Record:
        return cls(
            event=AuditEvent.from_json(doc),
            writer=str(doc["writer"]),
            seq=int(doc["seq"]),
            prev_hash=str(doc["prev_hash"]),
            hash=str(doc["hash"]),
            position=position,
        )


def record_hash(prev_hash: str, writer: str, seq: int, event: AuditEvent) -> str:
    """SHA-256 (hex) of ``prev_hash`` + ``repr((writer, seq, *event fields in FIELDS order))``.

    `repr` of a tuple of str/int/float/None is unambiguous (strings are quoted and escaped) and
    cheap; every store gives the same Python types back, so the hash is store-independent.
    """
    return hash_values(prev_hash, writer, seq, event_values(event))


def event_values(event: AuditEvent) -> tuple[object, ...]:
    """The event's field values in `FIELDS` order (what the chain hash covers)."""
    e = event
    return (
        e.time,
        e.instance,
        e.client,
        e.audience,
        e.kid,
        e.op,
        e.outcome,
        e.reason,
        e.fingerprint,
        e.generation,
        e.duration_ms,
    )


def hash_values(prev_hash: str, writer: str, seq: int, values: tuple[object, ...]) -> str:
    """`record_hash` over values already in `FIELDS` order."""
    return hashlib.sha256((prev_hash + repr((writer, seq, *values))).encode("utf-8", "surrogatepass")).hexdigest()


def batch_hash(prev_hash: str, rows: list[tuple[object, ...]]) -> str:
    """SHA-256 (hex) of `prev_hash` + ``repr(rows)``: one batch's link. `rows` are in SQL column
    order (`FIELDS`, writer, seq, prev_hash, hash) with empty ``prev_hash`` and ``hash``; `repr`
    of a list of tuples of str/int/float/None is unambiguous (built by `rows_repr`, the same text)."""
    return hashlib.sha256((prev_hash + rows_repr(rows)).encode("utf-8", "surrogatepass")).hexdigest()


def _unlinked_row(r: Record) -> tuple[object, ...]:
    return (*event_values(r.event), r.writer, r.seq, "", "")


class ChainWriter:
    """Links batches of events into one writer's chain; thread-safe (a lock around seq and head).

    `link_values` must be followed by a successful store append before the next link, or the
    chain has a gap: `rollback` restores the head when an append fails.
    """

    @property
    def seq(self) -> int:
        """The last seq linked (the next batch starts at ``seq + 1``)."""
        return self._seq

    def __init__(self, writer: str) -> None:
        self.writer = writer
        self._lock = threading.Lock()
        self._seq = 0
        self._head = GENESIS

    @property
    def lock(self) -> threading.Lock:
        """Held by the caller across `link` and the store append, so chain order is storage order."""
        return self._lock

    def link(self, events: Iterable[AuditEvent]) -> list[Record]:
        """Chain `events` one link per record, as writers did before batch chaining (kept so that
        stores written then, and tests of them, verify; call with `lock` held)."""
        out: list[Record] = []
        seq, head = self._seq, self._head
        for ev in events:
            seq += 1
            h = record_hash(head, self.writer, seq, ev)
            out.append(Record(ev, self.writer, seq, head, h))
            head = h
        self._saved = (self._seq, self._head)
        self._seq, self._head = seq, head
        return out

    def link_values(self, values: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
        """Chain one batch of value tuples in `FIELDS` order; returns them as rows in SQL column
        order (values, writer, seq, prev_hash, hash), the last one carrying the batch's link
        (call with `lock` held)."""
        writer = self.writer
        return self.link_rows([(*v, writer, seq, "", "") for seq, v in enumerate(values, self._seq + 1)])

    def link_rows(self, rows: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
        """Chain one batch of rows already in SQL column order, numbered from ``seq + 1`` with
        empty ``prev_hash`` and ``hash`` (the writer process builds them so); returns them with
        the last row's link filled in (call with `lock` held)."""
        if not rows:
            return rows
        head = self._head
        h = batch_hash(head, rows)
        out = rows.copy()  # `rows` stays unlinked, to be linked again after a `rollback`
        out[-1] = (*rows[-1][:-2], head, h)
        self._saved = (self._seq, self._head)
        self._seq, self._head = self._seq + len(rows), h
        return out

    def rollback(self) -> None:
        """Undo the last `link` (its records were not stored)."""
        self._seq, self._head = self._saved


@dataclass(frozen=True)
class Break:
    """The first problem found in one writer's chain."""

    kind: str  # deleted | altered | inserted | reordered | truncated
    writer: str
    position: int  # storage position (row/line) of the record where the break shows; 0 if none
    seq: int
    time: str | None
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "writer": self.writer,
            "position": self.position,
            "seq": self.seq,
            "time": self.time,
            "detail": self.detail,
        }


@dataclass
class VerifyReport:
    """What `verify` found: records and chains walked, and the breaks (first one per chain)."""

    records: int = 0
    chains: int = 0
    checkpoints_checked: int = 0
    breaks: list[Break] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.breaks

    @property
    def first(self) -> Break | None:
        return min(self.breaks, key=lambda b: b.position or 1 << 62, default=None)

    def to_json(self) -> dict[str, Any]:
        first = self.first
        return {
            "ok": self.ok,
            "records": self.records,
            "chains": self.chains,
            "checkpoints_checked": self.checkpoints_checked,
            "first_break": first.to_json() if first else None,
            "breaks": [b.to_json() for b in self.breaks],
        }


@dataclass
class _Walk:
    expected: int = 1
    head: str = GENESIS
    seen: set[int] = field(default_factory=set)
    hashes: dict[int, str] = field(default_factory=dict)
    broken: bool = False
    batch: list[Record] = field(default_factory=list)
    """Records of the batch being read (until the one that carries its hash)."""


def verify(records: Iterable[Record], checkpoints: Iterable[dict[str, Any]] = ()) -> VerifyReport:
    """Walk `records` in storage order and report the first break of every writer's chain.

    `checkpoints` are documents written by `make_checkpoint`; each head in them must still be in
    the store with the same hash (else a ``truncated`` or ``altered`` break).
    """
    report = VerifyReport()
    recs = list(records)
    report.records = len(recs)
    later: dict[str, set[int]] = {}
    for r in recs:
        later.setdefault(r.writer, set()).add(r.seq)
    walks: dict[str, _Walk] = {}
    for r in recs:
        w = walks.setdefault(r.writer, _Walk())
        if r.hash:
            w.hashes.setdefault(r.seq, r.hash)
        if w.broken:
            continue
        problem = _check(r, w, later[r.writer])
        if problem is None:
            w.seen.add(r.seq)
            w.expected = r.seq + 1
            w.batch.append(r)
            if r.hash:  # the batch's last record: check its link
                problem, at = _check_batch(w.batch, w.head), w.batch[0]
                w.batch = []
                w.head = r.hash
        else:
            at = r
        if problem is not None:
            kind, detail = problem
            report.breaks.append(Break(kind, r.writer, at.position, at.seq, at.event.time, detail))
            w.broken = True
    for writer, w in walks.items():
        if w.batch and not w.broken:
            first, end = w.batch[0], w.batch[-1]
            detail = (
                f"records seq {first.seq}..{end.seq} end without their batch's hash: its last records "
                "were deleted, or these were added"
            )
            report.breaks.append(Break("truncated", writer, first.position, first.seq, first.event.time, detail))
            w.broken = True
    report.chains = len(walks)
    for doc in checkpoints:
        for head in doc.get("heads", []):
            report.checkpoints_checked += 1
            writer, seq = str(head["writer"]), int(head["seq"])
            walk = walks.get(writer)
            if any(b.writer == writer for b in report.breaks):
                continue
            have = walk.hashes.get(seq) if walk else None
            found = checkpoint_break(doc, head, have, last=(walk.expected - 1) if walk else 0)
            if found is not None:
                report.breaks.append(found)
    return report


def checkpoint_break(doc: dict[str, Any], head: dict[str, Any], have: str | None, *, last: int) -> Break | None:
    """What one checkpoint `head` (of checkpoint document `doc`) says of the chain as stored: ``truncated``
    when the store has no record at the head's seq (`have` is None; the chain ends at seq `last`),
    ``altered`` when that record's batch hash `have` differs from the head's, else None."""
    writer, seq, want = str(head["writer"]), int(head["seq"]), str(head["hash"])
    if have is None:
        detail = f"checkpoint of {doc.get('time')} saw seq {seq}; the store ends at seq {last} (a cut-off tail)"
        return Break("truncated", writer, 0, seq, head.get("time"), detail)
    if have != want:
        detail = f"the record at seq {seq} differs from the checkpoint of {doc.get('time')} (chain rewritten)"
        return Break("altered", writer, 0, seq, head.get("time"), detail)
    return None


def _check(r: Record, w: _Walk, all_seqs: set[int]) -> tuple[str, str] | None:
    """The sequence checks of one record (its place in its writer's numbering)."""
    if r.seq == w.expected:
        return None
    if r.seq < w.expected:
        if r.seq in w.seen:
            return "inserted", f"record seq {r.seq} appears twice"
        return "reordered", f"record seq {r.seq} is stored after seq {w.expected - 1}"
    missing = range(w.expected, r.seq)
    if any(s in all_seqs for s in missing):
        return "reordered", f"record seq {r.seq} is stored before seq {w.expected}"
    if len(missing) == 1:
        return "deleted", f"record seq {w.expected} is missing (before seq {r.seq})"
    return "deleted", f"records seq {w.expected}..{r.seq - 1} are missing (before seq {r.seq})"


def _check_batch(batch: list[Record], head: str) -> tuple[str, str] | None:
    """The link of one batch (its last record carries it): content, then the link to `head`."""
    last = batch[-1]
    legacy = len(batch) == 1 and record_hash(last.prev_hash, last.writer, last.seq, last.event) == last.hash
    if not legacy and batch_hash(last.prev_hash, [_unlinked_row(r) for r in batch]) != last.hash:
        span = f"seq {batch[0].seq}..{last.seq}" if len(batch) > 1 else f"seq {last.seq}"
        return "altered", f"records {span}: their fields do not match their batch's hash"
    if last.prev_hash != head:
        return "inserted", f"the batch ending at seq {last.seq} does not link to the batch before it"
    return None


def heads(records: Iterable[Record]) -> list[dict[str, Any]]:
    """The last record (seq, hash, time) of every writer, in storage order."""
    last: dict[str, Record] = {}
    for r in records:
        prev = last.get(r.writer)
        if prev is None or r.seq > prev.seq:
            last[r.writer] = r
    return [{"writer": r.writer, "seq": r.seq, "hash": r.hash, "time": r.event.time} for r in last.values()]


def make_checkpoint(records: Iterable[Record], *, store_url: str, now: float) -> dict[str, Any]:
    """A checkpoint document: when, which store, and every chain's head."""
    return {"time": format_ts(now), "store": store_url, "heads": heads(records)}


def append_checkpoint(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Append `doc` as one JSON line to `path` (created mode 0600)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(json.dumps(doc, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_checkpoints(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The checkpoint documents in `path` (none if it does not exist).

    Raises:
        ConfigError: a line is not a checkpoint document, or `path` is not a regular file.
    """
    p = Path(path)
    if not p.exists():
        return
    if not p.is_file():  # a directory, FIFO or device (a link to /dev/zero was read until memory ran out)
        raise ConfigError(f"{p}: not a checkpoint file (not a regular file)")
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError:
                raise ConfigError(f"{p}:{n}: not a checkpoint (bad JSON)") from None
            if not isinstance(doc, dict) or not isinstance(doc.get("heads"), list):
                raise ConfigError(f"{p}:{n}: not a checkpoint")
            if not _well_formed(doc):
                raise ConfigError(
                    f"{p}:{n}: not a checkpoint (a head or cut without a writer, seq and hash, or a store_id not text)"
                )
            yield doc


def _well_formed(doc: dict[str, Any]) -> bool:
    """Every head and cut a dict of a text ``writer`` and ``hash`` and a whole ``seq`` >= 0, a
    ``store_id`` text if present (what the walks index by; an edited file crashed them)."""
    for part in ("heads", "cuts", "carried"):
        entries = doc.get(part, [])
        if not isinstance(entries, list):
            return False
        for e in entries:
            if not isinstance(e, dict) or not isinstance(e.get("writer"), str) or not isinstance(e.get("hash"), str):
                return False
            seq = e.get("seq")
            if seq.__class__ is not int or seq < 0:
                return False
    return doc.get("store_id") is None or isinstance(doc.get("store_id"), str)
