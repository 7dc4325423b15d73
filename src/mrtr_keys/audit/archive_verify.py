"""``audit verify --from-archive DIR|s3://...``: archived segments and the live store as one history.

1. **Manifests.** Every ``manifests/*.json`` is read. The newest one is the one the newest prune
   checkpoint names (``"archive"``: name and SHA-256), else the one no other names as ``previous``;
   from it the ``previous`` links (name and SHA-256) lead back to the first. A manifest whose
   SHA-256 differs from the one recorded for it, a missing one, or segments listed out of order
   (each chain's segments must follow one another: first seq = the last one's + 1, ``prev_hash`` =
   its ``hash``) is a break.
2. **Segments**, oldest manifest first: each file must exist, have the manifest's size and SHA-256,
   decompress, and hold the records listed (count, first and last seq, last batch hash). Their
   records are walked by the same `mrtr_keys.audit.verify_stream.Walker` as the store's rows, so an
   edit, deletion, insertion or reordering inside the archive is found as in a store.
3. **The link to the live store.** Each chain's last archived head must be the cut the store's
   prune checkpoints record for it (a chain pruned further than archived, or pruned without an
   archive, is a break); the walk then goes on through the live rows, whose first batch of each
   chain must link to that head.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from mrtr_keys.audit.archive import ARCHIVE, FORMAT, last_archive
from mrtr_keys.audit.archive_dest import Destination
from mrtr_keys.audit.chain import GENESIS, Break
from mrtr_keys.audit.verify_stream import PAGE, PRUNE, Progress, Start, StreamReport, Walker, prune_starts, walk_pages

KIND = "archive"
"""`Break.kind` of a problem with the archive's files (as opposed to the records in them)."""


@dataclass
class ArchiveReport(StreamReport):
    """`StreamReport` plus what the archive held."""

    location: str = ""
    manifests: int = 0
    segments: int = 0
    archived: int = 0
    unlisted: list[str] = field(default_factory=list)
    """Files in the location that no manifest on the chain lists (not verified; an interrupted
    ``audit archive`` run leaves segments published before its manifest, or a staging directory)."""

    def to_json(self) -> dict[str, Any]:
        return {
            **super().to_json(),
            "archive": {
                "location": self.location,
                "manifests": self.manifests,
                "segments": self.segments,
                "records": self.archived,
                "unlisted": self.unlisted,
            },
        }


class _Stop(Exception):
    def __init__(self, brk: Break) -> None:
        self.brk = brk


def _fail(detail: str, writer: str = "", seq: int = 0, when: str | None = None) -> _Stop:
    return _Stop(Break(KIND, writer, 0, seq, when, detail))


MANIFEST_MAX = 256 * 1024 * 1024
"""Bytes a manifest may have (about 400,000 segment entries): a larger file is not read whole."""


def _manifest(dest: Destination, name: str) -> tuple[dict[str, Any], str]:
    data = dest.get(name, MANIFEST_MAX)
    if data is None:
        raise _fail(f"manifest {name} is missing from {dest.uri}")
    if len(data) > MANIFEST_MAX:
        raise _fail(f"manifest {name} is larger than {MANIFEST_MAX:,} bytes (not a manifest mrtr-keys wrote)")
    try:
        doc = json.loads(data)
    except ValueError:
        raise _fail(f"manifest {name} is not JSON (changed after archiving)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("segments"), list):
        raise _fail(f"manifest {name} is not an mrtr-keys archive manifest ({FORMAT})")
    problem = _manifest_problem(doc)
    if problem:
        raise _fail(f"manifest {name} is not a valid archive manifest: {problem} (changed after archiving?)")
    return doc, hashlib.sha256(data).hexdigest()


_INTS = ("first_seq", "last_seq", "prev_seq", "records", "bytes")
_STRS = ("file", "writer", "prev_hash", "hash", "sha256")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _safe_name(name: object, folder: str) -> bool:
    """A relative ``FOLDER/...`` name inside the archive: no absolute path, ``..`` or empty part."""
    if not isinstance(name, str) or not name.startswith(folder + "/") or "\\" in name or "\0" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _manifest_problem(doc: dict[str, Any]) -> str | None:
    """What makes `doc` (a manifest with a segment list) unusable, or None: every value `verify`
    reads has its type, and every file name stays inside the archive."""
    for i, seg in enumerate(doc["segments"]):
        if not isinstance(seg, dict):
            return f"segment entry {i} is not an object"
        bad = [k for k in _INTS if not _is_int(seg.get(k))] + [k for k in _STRS if not isinstance(seg.get(k), str)]
        if bad:
            return f"segment entry {i} has no valid {', '.join(bad)}"
        if not _safe_name(seg["file"], "segments"):
            return f"segment entry {i} names a file outside the archive's segments/ ({seg['file']!r})"
    prev = doc.get("previous")
    if prev is not None and not (
        isinstance(prev, dict) and _safe_name(prev.get("manifest"), "manifests") and isinstance(prev.get("sha256"), str)
    ):
        return "its 'previous' link is not a manifest name and SHA-256"
    return None


def manifest_chain(
    dest: Destination, docs: Sequence[dict[str, Any]]
) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The manifests oldest first as (name, document), and the names of any not on the chain (left
    by an interrupted run). Raises `_Stop` on a broken chain of manifests."""
    names = [n for n in dest.list("manifests/") if n.endswith(".json")]
    anchor = last_archive(docs)
    if (
        anchor is not None
        and anchor.get("location") not in (None, dest.uri)
        and dest.get(str(anchor["manifest"]), 0) is None
    ):
        # the newest archive went elsewhere: check this one on its own links. (The same archive named
        # another way, ./a vs /abs/a, or copied to locked storage, holds the manifest: still checked
        # against the SHA-256 the checkpoint recorded.)
        anchor = None
    loaded: dict[str, tuple[dict[str, Any], str]] = {}
    if anchor is not None:
        newest = str(anchor["manifest"])
        want: str | None = str(anchor["sha256"])
        source = "the store's prune checkpoint"
    else:
        if not names:
            return [], []  # nothing archived yet (and no checkpoint names an archive): the live store alone
        for n in names:
            loaded[n] = _manifest(dest, n)
        named = {str((d.get("previous") or {}).get("manifest")) for d, _ in loaded.values()}
        tips = [n for n in names if n not in named]
        if len(tips) != 1:
            raise _fail(f"the manifests in {dest.uri} do not form one chain (it ends at {', '.join(tips) or 'none'})")
        newest, want, source = tips[0], None, ""
    chain: list[tuple[str, dict[str, Any]]] = []
    name: str | None = newest
    while name is not None:
        doc, sha = loaded.get(name) or _manifest(dest, name)
        if want is not None and sha != want:
            _check_order(name, doc)  # a clearer message if it was reordered
            raise _fail(
                f"manifest {name}: its SHA-256 does not match the one recorded in {source} (changed after archiving)"
            )
        _check_order(name, doc)
        chain.append((name, doc))
        prev = doc.get("previous")
        if isinstance(prev, dict) and prev.get("location") not in (None, dest.uri):
            raise _fail(
                f"manifest {name} follows one in another archive ({prev.get('location')}): verify that one first"
            )
        name = str(prev["manifest"]) if isinstance(prev, dict) else None
        want = str(prev.get("sha256")) if isinstance(prev, dict) else None
        source = f"manifest {chain[-1][0]}"
        if len(chain) > 100_000:
            raise _fail(f"the manifests in {dest.uri} loop")
    chain.reverse()
    on_chain = {n for n, _ in chain}
    return chain, [n for n in names if n not in on_chain]


def _check_order(name: str, doc: dict[str, Any]) -> None:
    last: dict[str, dict[str, Any]] = {}
    for seg in doc["segments"]:
        prior = last.get(seg["writer"])
        if prior is not None and (seg["first_seq"] != prior["last_seq"] + 1 or seg["prev_hash"] != prior["hash"]):
            raise _fail(
                f"manifest {name}: segment {seg['file']} (seq {seg['first_seq']}..{seg['last_seq']}) is listed "
                f"after {prior['file']} (seq {prior['first_seq']}..{prior['last_seq']}) but does not follow it "
                "(the manifest was reordered or edited)",
                seg["writer"],
                seg["first_seq"],
            )
        last[seg["writer"]] = seg


def _feed_segment(dest: Destination, seg: dict[str, Any], manifest: str, walker: Walker, base: int, page: int) -> int:
    """Check segment `seg` of `manifest` and feed its records to `walker` `page` at a time (memory:
    the compressed file and one page); returns how many it held. Raises `_Stop`."""
    name, writer, first = str(seg["file"]), str(seg["writer"]), int(seg["first_seq"])
    data = dest.get(name, int(seg["bytes"]))
    if data is None:
        raise _fail(f"segment {name} listed in manifest {manifest} is missing", writer, first, seg.get("first_time"))
    if len(data) != seg.get("bytes") or hashlib.sha256(data).hexdigest() != seg.get("sha256"):
        raise _fail(
            f"segment {name}: its SHA-256 does not match manifest {manifest} (the file was changed after archiving)",
            writer,
            first,
            seg.get("first_time"),
        )
    count, last = 0, None
    with gzip.GzipFile(fileobj=io.BytesIO(data)) as lines:
        while True:
            try:
                rows = [(base + count + i, *json.loads(line)) for i, line in enumerate(islice(lines, page), 1)]
            except (OSError, EOFError, zlib.error, ValueError, TypeError):
                raise _fail(f"segment {name} cannot be read as gzip JSON Lines", writer, first) from None
            if not rows:
                break
            if (count == 0 and rows[0][13] != first) or any(len(r) != 16 or r[12] != writer for r in rows):
                raise _fail(f"segment {name} does not hold what manifest {manifest} lists for it", writer, first)
            try:
                walker.feed(rows)
            except (TypeError, ValueError, AttributeError):  # a value of the wrong type (a rewritten segment)
                raise _fail(f"segment {name} holds records that are not audit records", writer, first) from None
            broken = walker.broken()
            if broken:
                b = broken[0]
                raise _Stop(Break(b.kind, b.writer, 0, b.seq, b.time, f"in archive segment {name}: {b.detail}"))
            count += len(rows)
            last = rows[-1]
            del rows
    if last is None or count != seg["records"] or last[13] != seg["last_seq"] or last[15] != seg["hash"]:
        raise _fail(f"segment {name} does not hold what manifest {manifest} lists for it", writer, first)
    return count


def verify_archive(
    dest: Destination,
    store: Any,
    docs: Sequence[dict[str, Any]],
    *,
    progress: Progress | None = None,
    page: int = PAGE,
) -> ArchiveReport:
    """Verify the archive in `dest`, then `store` (an `AuditStore`) from where it ends, as one
    history (see the module docstring). `docs`: this store's checkpoint documents, file order.

    Raises:
        mrtr_keys.errors.AuditError: the store or the destination cannot be read (a problem *in*
        the archive is a break in the report, not an exception).
    """
    started = time.monotonic()
    report = ArchiveReport(location=dest.uri)
    _, report.pruned_before = prune_starts(docs)
    walker = Walker(report=report)
    heads_docs = [d for d in docs if d.get("kind") != PRUNE]
    pairs = [(d, h) for d in heads_docs for h in d.get("heads", [])]
    for _, head in pairs:
        walker.expect_head(str(head["writer"]), int(head["seq"]))
    try:
        archived = _walk_archive(dest, docs, walker, report, progress, started, page)
        _link(archived, docs, walker)
    except _Stop as stop:
        report.breaks.append(stop.brk)
        report.seconds = time.monotonic() - started
        return report
    walk_pages(walker, store, 0, page, progress, started)
    walker.finish(pairs)
    report.seconds = time.monotonic() - started
    return report


def _walk_archive(
    dest: Destination,
    docs: Sequence[dict[str, Any]],
    walker: Walker,
    report: ArchiveReport,
    progress: Progress | None,
    started: float,
    page: int,
) -> dict[str, tuple[int, str]]:
    """Feed every archived record to `walker`; returns each chain's last archived head (seq, hash)."""
    chain, _ = manifest_chain(dest, docs)
    report.manifests = len(chain)
    listed = {name for name, _ in chain} | {str(seg["file"]) for _, doc in chain for seg in doc["segments"]}
    report.unlisted = [name for name in dest.list("") if name not in listed]
    heads: dict[str, tuple[int, str]] = {}
    for mname, doc in chain:
        for seg in doc["segments"]:
            writer = str(seg["writer"])
            have = heads.get(writer)
            if have is None:
                heads[writer] = have = (int(seg["prev_seq"]), str(seg["prev_hash"]))
                if have != (0, GENESIS):  # a chain pruned before it was first archived: trust the recorded cut
                    cut = _cut_at(docs, writer, have[0])
                    if cut is None or cut.hash != have[1]:
                        raise _fail(
                            f"segment {seg['file']} starts chain {writer} after seq {have[0]}, which no prune "
                            "checkpoint records: the records before it are neither archived nor pruned",
                            writer,
                            have[0] + 1,
                        )
                    _start_at(walker, cut)
            if (int(seg["prev_seq"]), str(seg["prev_hash"])) != have:
                raise _fail(
                    f"segment {seg['file']} (chain {writer}, seq {seg['first_seq']}..) does not follow the one "
                    f"before it in the archive (which ends at seq {have[0]}): a segment or manifest is missing "
                    "or out of order",
                    writer,
                    int(seg["first_seq"]),
                )
            n = _feed_segment(dest, seg, mname, walker, report.records, page)
            heads[writer] = (int(seg["last_seq"]), str(seg["hash"]))
            report.segments += 1
            report.archived += n
            if progress is not None:
                progress(report.records, time.monotonic() - started)
    return heads


def _start_at(walker: Walker, start: Start) -> None:
    walker.starts[start.writer] = start
    c = walker.chain(start.writer)
    c.start, c.expected, c.head, c.start_hash = start.seq, start.seq + 1, start.hash, start.hash


def _cut_at(docs: Sequence[dict[str, Any]], writer: str, seq: int) -> Start | None:
    for doc in docs:
        if doc.get("kind") == PRUNE:
            for cut in [*doc.get("cuts", []), *doc.get("carried", [])]:
                if str(cut["writer"]) == writer and int(cut["seq"]) == seq:
                    return Start(writer, seq, str(cut["hash"]), cut.get("time"), PRUNE)
    return None


def _link(archived: dict[str, tuple[int, str]], docs: Sequence[dict[str, Any]], walker: Walker) -> None:
    """Check each chain's archived head against the store's prune cuts; the live walk starts there."""
    cuts, _ = prune_starts(docs)
    for writer, cut in cuts.items():
        have = archived.get(writer)
        if have is None or have[0] < cut.seq:
            end = f"the archive ends at seq {have[0]}" if have else "the archive has none of its records"
            raise _fail(
                f"chain {writer} was pruned through seq {cut.seq} (before {cut.time}) but {end}: "
                "those records were pruned without an archive",
                writer,
                cut.seq,
                cut.time,
            )
        if have[0] > cut.seq or have[1] != cut.hash:
            raise _fail(
                f"chain {writer}: the archive's last head (seq {have[0]}) is not the store's prune cut (seq "
                f"{cut.seq}): the archive and the checkpoint file do not belong together",
                writer,
                cut.seq,
            )
    for writer, (seq, link) in archived.items():
        c = walker.chain(writer)
        c.start, c.start_hash = seq, link  # live rows at or before it: an interrupted prune


def has_archive(docs: Sequence[dict[str, Any]]) -> bool:
    """True if a prune checkpoint in `docs` names an archive."""
    return any(isinstance(d.get(ARCHIVE), dict) for d in docs)
