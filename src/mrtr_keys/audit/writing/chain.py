"""Tamper evidence: each writer's records form a chain of linked batches; `verify` walks them.

Every record carries ``writer`` (one chain per writing process and store) and ``seq`` (1, 2, 3, ...
within that writer). The writer links each committed batch (one store transaction) once: the
batch's last record carries ``prev_hash`` (the previous batch's ``hash``; 64 zeros for the first)
and ``hash``, the link over ``prev_hash`` and the ``repr`` of the batch's rows in order (every
event field, ``writer`` and ``seq`` of each, with empty ``prev_hash``/``hash``): an HMAC under the
chain key (chain version 2, `mrtr_keys.audit.writing.chain_key`), or SHA-256 in stores written before it;
the batch's other records carry empty ``prev_hash`` and ``hash``. (Records written before batch
chaining carry a link each, a batch of one hashed as `record_hash`; `verify` reads both.) Walking a
store in its storage order (row id, or line order for JSONL,
`mrtr_keys.audit.verifying.verify_stream`) then shows:

* altered: a batch's records no longer give its ``hash`` (reported at the batch's first record);
* deleted: a writer's ``seq`` skips numbers;
* reordered: a ``seq`` arrives early and the skipped ones turn up later;
* inserted: a record repeats an earlier ``seq``, or a batch does not link to its predecessor;
* truncated: a writer's records end without their batch's hash (the end of a batch deleted, or
  records appended).

What a chain alone cannot show: a cut-off tail (the newest batches of a writer deleted, or a
whole writer's records removed). The remedy is a record of the heads kept where the store's
writers cannot rewrite it: a checkpoint (``mrtr-keys audit checkpoint``) or an anchor the service
writes itself (`mrtr_keys.audit.verifying.anchor`); ``verify`` then checks that each recorded head is still in
the store, unchanged (`mrtr_keys.audit.verifying.trust`). See docs/audit.md.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mrtr_keys.audit.events import AuditEvent, format_ts
from mrtr_keys.audit.writing.chain_key import ChainKey
from mrtr_keys.audit.writing.row_repr import rows_repr

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


class ChainWriter:
    """Links batches of events into one writer's chain; thread-safe (a lock around seq and head).

    With a `key`, each batch's link is keyed (chain version 2, `mrtr_keys.audit.writing.chain_key`).

    `link_values` must be followed by a successful store append before the next link, or the
    chain has a gap: `rollback` restores the head when an append fails.
    """

    @property
    def seq(self) -> int:
        """The last seq linked (the next batch starts at ``seq + 1``)."""
        return self._seq

    def __init__(self, writer: str, key: ChainKey | None = None) -> None:
        self.writer = writer
        self.key = key
        """The chain key its batches are linked with (`mrtr_keys.audit.writing.chain_key`; None: unkeyed links)."""
        self._lock = threading.Lock()
        self._seq = 0
        self._head = GENESIS
        self._time = ""

    @property
    def head(self) -> tuple[int, str, str] | None:
        """(seq, hash, event time) of the last batch end linked, None before the first."""
        return (self._seq, self._head, self._time) if self._seq else None

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
        self._saved = (self._seq, self._head, self._time)
        self._seq, self._head = seq, head
        if out:
            self._time = out[-1].event.time
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
        h = batch_hash(head, rows) if self.key is None else self.key.link(head, rows_repr(rows))
        out = rows.copy()  # `rows` stays unlinked, to be linked again after a `rollback`
        out[-1] = (*rows[-1][:-2], head, h)
        self._saved = (self._seq, self._head, self._time)
        self._seq, self._head, self._time = self._seq + len(rows), h, str(rows[-1][0])
        return out

    def rollback(self) -> None:
        """Undo the last `link` (its records were not stored)."""
        self._seq, self._head, self._time = self._saved


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
