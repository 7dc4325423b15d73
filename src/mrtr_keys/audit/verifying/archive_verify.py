"""``audit verify --from-archive DIR|s3://...``: archived segments and the live store as one history.

1. **Manifests.** Every ``manifests/*.json`` is read. The newest one is the one the newest prune
   checkpoint names (``"archive"``: name and SHA-256), else the one no other names as ``previous``;
   from it the ``previous`` links (name and SHA-256) lead back to the first. A manifest whose
   SHA-256 differs from the one recorded for it, a missing one, or segments listed out of order
   (each chain's segments must follow one another: first seq = the last one's + 1, ``prev_hash`` =
   its ``hash``) is a break.
2. **Segments**, oldest manifest first: each file must exist, have the manifest's size and SHA-256,
   decompress, and hold the records listed (count, first and last seq, last batch hash). Their
   records are walked by the same `mrtr_keys.audit.verifying.verify_stream.Walker` as the store's rows, so an
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

from mrtr_keys.audit.retention.archive import FORMAT
from mrtr_keys.audit.retention.archive_dest import Destination
from mrtr_keys.audit.verifying.trust import Trust, gather
from mrtr_keys.audit.verifying.verify_stream import PAGE, Progress, Start, StreamReport, Walker, walk_pages
from mrtr_keys.audit.writing.chain import GENESIS, Break
from mrtr_keys.audit.writing.chain_key import ChainKeys, is_keyed

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
    except (ValueError, RecursionError):
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


Located = tuple[Destination, str, dict[str, Any]]
"""(the location holding it, its name, the manifest) of one manifest on the chain."""


def manifest_chain(dests: Sequence[Destination], trust: Trust) -> tuple[list[Located], list[tuple[Destination, str]]]:
    """The manifests oldest first, each with its location, and (location, name) of any in the given
    locations not on the chain (left by an interrupted run). The newest is the one the newest prune
    record names (its SHA-256 as recorded), found in whichever of `dests` holds it (the same archive
    named another way, ./a or /abs/a, or copied to locked storage, holds it too); from it the
    ``previous`` links lead back, into another location where the archive moved (a ``previous`` naming
    one: one of `dests`, else the location as recorded). Without a prune record naming an archive, the
    chain is the one the first location's manifests form. Raises `_Stop` on a broken chain of manifests."""
    named = {d.uri: [n for n in d.list("manifests/") if n.endswith(".json")] for d in dests}
    refs = trust.archives
    ref = refs[-1] if refs else None
    start = _holder(dests, ref, named) if ref is not None else None
    if ref is None or start is None:
        first = dests[0]
        names = named[first.uri]
        if not names:
            return [], []  # nothing archived yet (and no checkpoint names an archive here): the live store alone
        loaded = {n: _manifest(first, n) for n in names}
        pointed = {str((d.get("previous") or {}).get("manifest")) for d, _ in loaded.values()}
        tips = [n for n in names if n not in pointed]
        if len(tips) != 1:
            raise _fail(f"the manifests in {first.uri} do not form one chain (it ends at {', '.join(tips) or 'none'})")
        dest, name, want, source = first, tips[0], None, ""
    else:
        dest, name, want, source = start, str(ref["manifest"]), str(ref["sha256"]), "the store's prune checkpoint"
    chain: list[Located] = []
    while True:
        doc, sha = _manifest(dest, name)
        if want is not None and sha != want:
            _check_order(name, doc)  # a clearer message if it was reordered
            raise _fail(
                f"manifest {name}: its SHA-256 does not match the one recorded in {source} (changed after archiving)"
            )
        _check_order(name, doc)
        chain.append((dest, name, doc))
        prev = doc.get("previous")
        if not isinstance(prev, dict):
            break
        name, want, source = str(prev["manifest"]), str(prev.get("sha256")), f"manifest {name}"
        if prev.get("location") not in (None, dest.uri):
            moved = _holder(dests, prev, named) or _open_recorded(str(prev["location"]), name)
            dest = moved
        if len(chain) > 100_000:
            raise _fail(f"the manifests in {dest.uri} loop")
    chain.reverse()
    on_chain = {(d.uri, n) for d, n, _ in chain}
    return chain, [(d, n) for d in dests for n in named[d.uri] if (d.uri, n) not in on_chain]


def _holder(dests: Sequence[Destination], ref: dict[str, Any], named: dict[str, list[str]]) -> Destination | None:
    """The one of `dests` that holds the manifest `ref` names: the location it records, else one that has a
    manifest of that name (the same archive named another way)."""
    name = str(ref.get("manifest"))
    for d in dests:
        if d.uri == ref.get("location"):
            return d
    return next((d for d in dests if name in named[d.uri]), None)


def _open_recorded(location: str, name: str) -> Destination:
    from mrtr_keys.audit.retention.archive_dest import open_destination
    from mrtr_keys.errors import ConfigError

    try:
        dest = open_destination(location)
        if dest.get(name, 0) is not None:
            return dest
    except ConfigError:
        pass
    raise _fail(
        f"manifest {name} is in another archive location, {location}, which cannot be read here: name it too "
        "(--from-archive, once per location)"
    )


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
            except (OSError, EOFError, zlib.error, ValueError, TypeError, RecursionError):
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
    dests: Destination | Sequence[Destination],
    store: Any,
    docs: Sequence[dict[str, Any]],
    *,
    progress: Progress | None = None,
    page: int = PAGE,
    keys: ChainKeys | None = None,
) -> ArchiveReport:
    """Verify the archive in `dests` (one location, or several an archive moved between, in any order),
    then `store` (an `AuditStore`) from where it ends, as one history (see the module docstring).
    `docs`: the trusted records (`mrtr_keys.audit.verifying.trust.gather`: this store's are used); `keys`: the chain
    keys of keyed links.

    Raises:
        mrtr_keys.errors.AuditError: the store or a location cannot be read (a problem *in* the archive is
        a break in the report, not an exception).
    """
    started = time.monotonic()
    dests = [dests] if not isinstance(dests, Sequence) else list(dests)
    report = ArchiveReport(location=", ".join(d.uri for d in dests))
    trust = gather(store, docs, keys=keys)
    walker = trust.walker(report=report)
    walker.starts = {}  # from genesis: the archive holds what was cut, and links to each cut (`_link`)
    try:
        archived = _walk_archive(dests, trust, walker, report, progress, started, page)
        _link(archived, trust, walker)
    except _Stop as stop:
        report.breaks.append(stop.brk)
        report.seconds = time.monotonic() - started
        return report
    walk_pages(walker, store, 0, page, progress, started)
    trust.finish(walker)
    report.seconds = time.monotonic() - started
    return report


def _walk_archive(
    dests: Sequence[Destination],
    trust: Trust,
    walker: Walker,
    report: ArchiveReport,
    progress: Progress | None,
    started: float,
    page: int,
) -> dict[str, tuple[int, str]]:
    """Feed every archived record to `walker`; returns each chain's last archived head (seq, hash)."""
    chain, _ = manifest_chain(dests, trust)
    report.manifests = len(chain)
    if chain:
        report.location = ", ".join(dict.fromkeys(d.uri for d, _, _ in reversed(chain)))
    for dest in dests:
        listed = {n for d, n, _ in chain if d is dest} | {
            str(seg["file"]) for d, _, doc in chain if d is dest for seg in doc["segments"]
        }
        prefix = "" if len(dests) == 1 else f"{dest.uri}: "
        report.unlisted += [prefix + name for name in dest.list("") if name not in listed]
    heads: dict[str, tuple[int, str]] = {}
    for dest, mname, doc in chain:
        for seg in doc["segments"]:
            writer = str(seg["writer"])
            have = heads.get(writer)
            if have is None:
                heads[writer] = have = (int(seg["prev_seq"]), str(seg["prev_hash"]))
                if have != (0, GENESIS):  # a chain pruned before it was first archived: trust the recorded cut
                    cut = trust.cut_at(writer, have[0])
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
    c.closed, c.keyed = start.seq, is_keyed(start.hash)


def _link(archived: dict[str, tuple[int, str]], trust: Trust, walker: Walker) -> None:
    """Check each chain's archived head against the store's prune cuts; the live walk starts there."""
    for writer, cut in trust.starts.items():
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
