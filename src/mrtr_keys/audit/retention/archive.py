"""``audit archive --before T --to DIR|s3://...``: the events a prune deletes, kept as files a later
verifier can check, then the prune (`mrtr_keys.audit.retention.prune`).

One pass: the prune's verifying walk shows every page to an `Archiver`, which keeps each chain's
records up to that chain's cut (the newest verified batch end before `T`) and writes them as
**segments**, one per chain and UTC day (also closed at `SEGMENT_RECORDS` records), always at batch
boundaries so each segment links to the one before it. A segment is JSON Lines (one JSON array a
record: the values of `SQL_COLUMNS`, exactly what the batch hash covers) compressed with gzip
(stdlib), written as one gzip member per page (a multi-member gzip file, which any gunzip reads).

When the walk is done (and found nothing broken), the segments are published, then a **manifest**
``manifests/RUN.json`` (`FORMAT`): per segment its file, chain, first and last seq, record and batch
counts, first and last event time, the link in (``prev_seq``, ``prev_hash``: the head before it) and
out (``hash``: its last batch hash), byte size and SHA-256; each chain's ``heads`` (the cuts); and
``previous``, the name and SHA-256 of the manifest before it (the manifests form a chain, like
CloudTrail digest files). The prune then records, in the checkpoint that carries its cuts, the
manifest's name and SHA-256 (``"archive"``), and deletes. ``audit verify --from-archive``
(`mrtr_keys.audit.verifying.archive_verify`) walks manifests, segments and the live store as one history.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from pathlib import Path
from typing import Any

from mrtr_keys.audit.retention.archive_dest import Destination
from mrtr_keys.audit.retention.prune import Progress, PruneResult, prune
from mrtr_keys.audit.verifying.ledger import ARCHIVE
from mrtr_keys.audit.verifying.verify_stream import Walker
from mrtr_keys.audit.writing.chain import GENESIS
from mrtr_keys.audit.writing.chain_key import ChainKeys
from mrtr_keys.audit.writing.stores.base import SQL_COLUMNS
from mrtr_keys.errors import AuditError
from mrtr_keys.urls import redact

FORMAT = "mrtr-keys-audit-archive/1"
SEGMENT_RECORDS = 250_000
"""A chain's segment is closed at the first batch end past this many records (or a new UTC day)."""
LEVEL = 1
"""gzip level: 1 keeps the write rate above 200,000 events/s (about 8x smaller than the text)."""


def _refuse(value: object) -> object:
    raise TypeError(f"an audit row holds a {type(value).__name__}")


# The C encoder made once (`json.JSONEncoder.encode` builds one per call: half the cost of a row).
# Arguments as `json.encoder.JSONEncoder.iterencode` passes them: no circular check, compact
# separators, ASCII output, NaN refused.
_row_json = c_make_encoder(None, _refuse, encode_basestring_ascii, None, ":", ",", False, False, False)


def _lines(rows: Sequence[tuple[Any, ...]]) -> str:
    """One JSON array a row (its values after the position), a line each: the page encoded by one
    call of the C encoder and split at the row boundaries (``],[``), unless a value holds that
    text too (then row by row)."""
    text = "".join(_row_json([r[1:] for r in rows], 0))[1:-1]
    if text.count("],[") == len(rows) - 1:
        return text.replace("],[", "]\n[") + "\n"
    return "\n".join(["".join(_row_json(r[1:], 0)) for r in rows]) + "\n"


_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class _Segment:
    __slots__ = ("batches", "bytes", "day", "first_seq", "first_time", "last_time", "path", "prev_hash",
                 "prev_seq", "records", "sha", "tail_closed")  # fmt: skip

    def __init__(self, path: Path, prev_seq: int, prev_hash: str, day: str) -> None:
        self.path = path
        self.prev_seq, self.prev_hash = prev_seq, prev_hash
        self.first_seq = prev_seq + 1
        self.day = day
        self.records = self.batches = self.bytes = 0
        self.first_time = self.last_time = ""
        self.sha = hashlib.sha256()
        self.tail_closed = False


class _Chain:
    __slots__ = ("head_hash", "head_seq", "n", "pending", "segment", "start", "writer")

    def __init__(self, writer: str, n: int, start: int, start_hash: str) -> None:
        self.writer, self.n = writer, n
        self.start = self.head_seq = start
        self.head_hash = start_hash
        self.pending: list[tuple[Any, ...]] = []
        self.segment: _Segment | None = None


def segment_stem(writer: str) -> str:
    """A file-name-safe form of a chain's writer id (with a short hash: distinct writers stay distinct)."""
    digest = hashlib.sha256(writer.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{_SAFE.sub('_', writer)[:80]}.{digest}"


@dataclass
class Archiver:
    """The `mrtr_keys.audit.retention.prune.ArchiveTap` of one run: builds segments in `dest`'s staging
    directory while the prune walks, publishes them and the manifest in `seal`."""

    dest: Destination
    run: str
    before: str
    store_url: str
    previous: dict[str, Any] | None = None
    segment_records: int = SEGMENT_RECORDS
    entries: list[dict[str, Any]] = field(default_factory=list)
    records: int = 0
    bytes: int = 0
    seconds: float = 0.0
    """Time spent building and publishing segments (the export part of the run)."""
    manifest: str | None = None
    store_id: str | None = None
    """The store's id (`mrtr_keys.audit.verifying.store_match`), recorded in the manifest beside its URL."""
    _chains: dict[str, _Chain] = field(default_factory=dict)
    _files: list[tuple[str, Path]] = field(default_factory=list)
    _staging: Path | None = None

    def __post_init__(self) -> None:
        self._staging = self.dest.staging()

    def close(self) -> None:
        """Remove the staging directory (whatever was not published)."""
        if self._staging is not None:
            self.dest.cleanup(self._staging)
            self._staging = None

    def page(self, rows: Sequence[tuple[Any, ...]], walker: Walker) -> None:
        started = time.perf_counter()
        chains = self._chains
        touched: set[_Chain] = set()
        for row in rows:
            c = chains.get(row[12])
            if c is None:
                c = self._chain(row[12], walker)
            if row[13] > c.start:
                c.pending.append(row)
                touched.add(c)
        for c in touched:
            cut = walker.cuts.get(c.writer)
            if cut is not None and cut[0] > c.head_seq:
                self._flush(c, cut[0])
        self.seconds += time.perf_counter() - started

    def _chain(self, writer: str, walker: Walker) -> _Chain:
        start = walker.starts.get(writer)
        c = _Chain(writer, len(self._chains), start.seq if start else 0, start.hash if start else GENESIS)
        self._chains[writer] = c
        return c

    def _flush(self, c: _Chain, upto: int) -> None:
        """Write `c`'s pending records up to seq `upto` (a verified batch end) into its segments."""
        pending = c.pending
        take = upto - pending[0][13] + 1  # a verified chain's pending records have consecutive seqs
        rows, c.pending = pending[:take], pending[take:]
        if rows[-1][13] != upto:
            raise AuditError(f"archive: chain {c.writer}: records out of step at seq {upto}")
        seg = c.segment
        begin = 0
        cap = self.segment_records
        for i, row in enumerate(rows):
            if seg is None:
                seg = self._open(c, row)
            elif seg.tail_closed and (seg.records >= cap or row[1][:10] != seg.day):
                self._append(seg, rows[begin:i])
                self._close(c, seg)
                begin = i
                seg = self._open(c, row)
            seg.records += 1
            link = row[15]
            seg.tail_closed = bool(link)
            if link:
                seg.batches += 1
                c.head_seq, c.head_hash = row[13], link
        c.segment = seg
        self._append(seg, rows[begin:])  # type: ignore[arg-type]

    def _open(self, c: _Chain, row: tuple[Any, ...]) -> _Segment:
        assert self._staging is not None
        path = self._staging / f"open-{c.n}-{row[13]}.jsonl.gz"
        seg = _Segment(path, c.head_seq, c.head_hash, row[1][:10])
        seg.first_time = row[1]
        return seg

    def _append(self, seg: _Segment, rows: Sequence[tuple[Any, ...]]) -> None:
        if not rows:
            return
        text = _lines(rows)
        comp = zlib.compressobj(LEVEL, zlib.DEFLATED, 31)  # 31: a gzip member
        data = comp.compress(text.encode("utf-8")) + comp.flush()
        with seg.path.open("ab") as f:
            f.write(data)
        seg.sha.update(data)
        seg.bytes += len(data)
        seg.last_time = rows[-1][1]

    def _close(self, c: _Chain, seg: _Segment) -> None:
        last = seg.first_seq + seg.records - 1
        name = f"segments/{self.run}/{segment_stem(c.writer)}.{seg.first_seq:012d}-{last:012d}.jsonl.gz"
        self._files.append((name, seg.path))
        self.entries.append(
            {
                "file": name,
                "writer": c.writer,
                "first_seq": seg.first_seq,
                "last_seq": last,
                "records": seg.records,
                "batches": seg.batches,
                "first_time": seg.first_time,
                "last_time": seg.last_time,
                "prev_seq": seg.prev_seq,
                "prev_hash": seg.prev_hash,
                "hash": c.head_hash,
                "bytes": seg.bytes,
                "sha256": seg.sha.hexdigest(),
            }
        )
        self.records += seg.records
        self.bytes += seg.bytes
        c.segment = None

    def seal(self, cuts: list[dict[str, Any]]) -> dict[str, Any]:
        """Close every segment, check each chain ends at its cut, publish segments then the manifest."""
        started = time.perf_counter()
        for cut in cuts:
            c = self._chains.get(str(cut["writer"]))
            if c is None or c.head_seq != int(cut["seq"]) or c.head_hash != cut["hash"]:
                raise AuditError(f"archive: chain {cut['writer']} does not end at its cut (seq {cut['seq']})")
            if c.segment is not None:
                self._close(c, c.segment)
        put_files = getattr(self.dest, "put_files", None)
        if put_files is not None:  # a directory: one fsync of the segments' directory, not one each
            put_files(self._files)
        for name, path in self._files if put_files is None else ():
            self.dest.put_file(name, path)
        doc = {
            "format": FORMAT,
            "run": self.run,
            "store": redact(self.store_url),
            **({"store_id": self.store_id} if self.store_id else {}),
            "before": self.before,
            "columns": list(SQL_COLUMNS),
            "compression": "gzip",
            "previous": self.previous,
            "records": self.records,
            "segments": self.entries,
            "heads": cuts,
        }
        data = (json.dumps(doc, indent=1) + "\n").encode("utf-8")
        self.manifest = f"manifests/{self.run}.json"
        self.dest.put_bytes(self.manifest, data)
        self.seconds += time.perf_counter() - started
        return {
            "location": self.dest.uri,
            "manifest": self.manifest,
            "sha256": hashlib.sha256(data).hexdigest(),
            "segments": len(self.entries),
            "records": self.records,
        }


def last_archive(docs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``archive`` reference of the newest prune checkpoint that has one, or None."""
    found = [d[ARCHIVE] for d in docs if isinstance(d.get(ARCHIVE), dict)]
    return found[-1] if found else None


@dataclass
class ArchiveResult:
    """What ``audit archive`` did: the prune, the manifest, the segments and the time spent writing them."""

    prune: PruneResult
    location: str
    manifest: str | None
    segments: int
    records: int
    bytes: int
    write_seconds: float
    retention: str

    def to_json(self) -> dict[str, Any]:
        rate = self.records / self.write_seconds if self.write_seconds > 0 else None
        return {
            **self.prune.to_json(),
            "location": self.location,
            "manifest": self.manifest,
            "segments": self.segments,
            "archived": self.records,
            "archive_bytes": self.bytes,
            "write_seconds": round(self.write_seconds, 3),
            "write_records_per_second": round(rate) if rate else None,
            "retention": self.retention,
        }


def archive(
    store: Any,
    before: str,
    docs: Sequence[dict[str, Any]],
    checkpoint_path: str | os.PathLike[str],
    dest: Destination,
    *,
    now: float | None = None,
    progress: Progress | None = None,
    segment_records: int = SEGMENT_RECORDS,
    keys: ChainKeys | None = None,
) -> ArchiveResult:
    """Archive to `dest` the records of `store` a ``prune(store, before, docs, ...)`` deletes, then
    prune (see the module docstring). Nothing is deleted unless every segment and the manifest
    were published. `keys`: as `prune` takes them.

    Raises:
        ConfigError: a JSON-lines store, or a destination that cannot be used as asked;
        AuditError: a chain before the cut is broken (nothing archived or deleted), or the store or
        the destination cannot be read or written.
    """
    moment = time.time() if now is None else now
    run = time.strftime("%Y%m%dT%H%M%S", time.gmtime(moment)) + f".{int(moment % 1 * 1e6):06d}Z"
    previous = last_archive(docs)
    ref = None if previous is None else {k: previous.get(k) for k in ("location", "manifest", "sha256")}
    archiver = Archiver(
        dest, run, before, store.url, ref, segment_records=segment_records, store_id=getattr(store, "store_id", None)
    )
    try:
        result = prune(
            store, before, docs, str(checkpoint_path), now=now, progress=progress, archive=archiver, keys=keys
        )
    finally:
        archiver.close()
    return ArchiveResult(
        prune=result,
        location=dest.uri,
        manifest=archiver.manifest,
        segments=len(archiver.entries),
        records=archiver.records,
        bytes=archiver.bytes,
        write_seconds=archiver.seconds,
        retention=dest.retention(),
    )
