"""Retention that keeps the proof: ``audit prune --before T`` cuts every chain at a batch boundary.

1. **Verify and plan.** The records stored before the newest one older than `T` are walked as
   ``verify`` walks them (from each chain's earlier prune cut, `mrtr_keys.audit.verifying.verify_stream`):
   a broken chain refuses the prune (deleting would destroy the evidence). Each chain's cut is
   its newest verified batch end with an event time before `T`: whole batches only, so what
   stays always starts with a batch that links to the cut.
2. **Record the cut.** A checkpoint document ``{"kind": "prune", "before": T, "cuts": [{writer,
   seq, hash, time}, ...]}`` is appended (and fsynced) to the checkpoint file before anything is
   deleted (with the store id, and as ``carried`` the cuts of earlier prunes recorded without one, of
   chains not cut now): ``verify`` then starts each chain after its cut, so a later deletion that is not a
   prune is still a gap, and an edit, insertion or reordering of the kept records still breaks
   their links.
3. **Drop whole partitions.** On PostgreSQL (schemas 4 and 5, partitioned by day) a day partition that ends
   before `T` and holds nothing after a chain's cut is dropped at once
   (`mrtr_keys.audit.writing.stores.postgres.PostgresStore.drop_partitions`): no row-by-row delete, no
   vacuum debt.
4. **Delete in bounded batches** what remains before the cuts: pages of `DELETE_PAGE` records in
   storage order, each deleted in one short transaction (a range when the whole page goes, else by
   id), so writers are never held up for long. Records at or before a cut left by an interrupted prune are deleted too.

SQLite and PostgreSQL stores; a JSON-lines log is rotated by its shipper instead (ConfigError).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mrtr_keys.audit.events import format_ts
from mrtr_keys.audit.verifying.ledger import PRUNE, FileLedger
from mrtr_keys.audit.verifying.store_match import stamp
from mrtr_keys.audit.verifying.trust import gather, prune_starts
from mrtr_keys.audit.verifying.verify_stream import PAGE, Walker
from mrtr_keys.audit.writing.chain_key import ChainKeys
from mrtr_keys.audit.writing.stores.hours import ODD, hour_of
from mrtr_keys.errors import AuditError, ConfigError

DELETE_PAGE = 5_000
"""Records deleted per transaction: a short write lock (SQLite) or a short transaction (PostgreSQL)."""
Progress = Callable[[str, int, float], None]
"""``progress(phase, records, seconds)``: phase ``verify`` or ``delete``."""


class ArchiveTap(Protocol):
    """What `prune` hands the records it is about to delete to (`mrtr_keys.audit.retention.archive.Archiver`)."""

    def page(self, rows: Sequence[tuple[Any, ...]], walker: Walker) -> None:
        """One page of raw rows just fed to `walker` (its ``cuts`` say how far each chain is cut)."""

    def seal(self, cuts: list[dict[str, Any]]) -> dict[str, Any]:
        """Finish the archive up to `cuts` (writer, seq, hash, time); what to record in the checkpoint."""


@dataclass
class PruneResult:
    """What a prune did: the cut-off, the chains cut, the records deleted and where the proof went."""

    before: str
    checkpoint: str | None = None
    cuts: list[dict[str, Any]] = field(default_factory=list)
    checked: int = 0
    deleted: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "before": self.before,
            "checkpoint": self.checkpoint,
            "cuts": self.cuts,
            "checked": self.checked,
            "deleted": self.deleted,
            "seconds": round(self.seconds, 3),
        }


def prune(
    store: Any,
    before: str,
    docs: Sequence[dict[str, Any]],
    checkpoint_path: str,
    *,
    now: float | None = None,
    page: int = PAGE,
    progress: Progress | None = None,
    archive: ArchiveTap | None = None,
    keys: ChainKeys | None = None,
) -> PruneResult:
    """Delete the records of `store` older than `before` (an event time string) chain by chain at
    batch boundaries, after appending the cut to `checkpoint_path` (see the module docstring).
    `docs`: the checkpoint documents already written for this store (`mrtr_keys.audit.verifying.store_match`;
    earlier prunes set where
    each chain's walk starts). `archive` (``audit archive``, `mrtr_keys.audit.retention.archive`) is shown
    every verified page and, before the checkpoint is written, asked to seal what it kept: what it
    returns goes in the checkpoint as ``"archive"``; if it raises, nothing is written or deleted.
    `keys`: the chain keys the walk checks keyed links with (`mrtr_keys.audit.writing.chain_key`), and that
    MAC the checkpoint it writes.

    Raises:
        ConfigError: the store cannot be pruned (JSONL); AuditError: a chain before the cut is
        broken (nothing is deleted), or the store cannot be read or written.
    """
    if not hasattr(store, "delete_positions"):
        raise ConfigError(
            f"{store.url}: a JSON-lines audit log is not pruned by mrtr-keys; rotate it with your log "
            "shipper (or use a SQLite or PostgreSQL store)"
        )
    started = time.monotonic()
    result = PruneResult(before=before)
    trust = gather(store, docs, keys=keys)
    starts = trust.starts
    high = store.last_position_before(before)
    walker = trust.walker(heads=False, skip_before_start=True, cut_before=before)
    for rows in store.row_batches(0, page):
        if rows[0][0] > high:
            break
        kept = [r for r in rows if r[0] <= high]
        walker.feed(kept)
        if archive is not None:
            archive.page(kept, walker)
        del rows, kept  # one page alive at a time
        if progress is not None:
            progress("verify", walker.report.records, time.monotonic() - started)
    result.checked = walker.report.records
    broken = walker.broken() + trust.problems(walker.report.keyed)
    if broken:
        b = min(broken, key=lambda b: b.position or 1 << 62)
        raise AuditError(
            f"not pruning: chain {b.writer} is broken before the cut ({b.kind} at position {b.position}, seq "
            f"{b.seq}: {b.detail}); pruning would delete the evidence (see mrtr-keys audit verify)"
        )
    limits = {w: s.seq for w, s in starts.items()}
    for writer, (seq, link, when) in walker.cuts.items():
        result.cuts.append({"writer": writer, "seq": seq, "hash": link, "time": when})
        limits[writer] = max(limits.get(writer, 0), seq)
    if not limits:
        result.seconds = time.monotonic() - started
        return result  # nothing before the cut-off
    if result.cuts:
        doc = {
            "time": format_ts(time.time() if now is None else now),
            "store": store.url,
            "kind": PRUNE,
            "before": before,
            "heads": [],
            "cuts": result.cuts,
        }
        stamp(doc, store)  # the store id: `verify` finds this cut however the store is named
        carried = _carried(docs, store, walker.cuts)
        if carried:
            doc["carried"] = carried
        if archive is not None:
            doc["archive"] = archive.seal(result.cuts)
        if keys is not None:
            keys.current.sign(doc)
        FileLedger(Path(checkpoint_path)).append(doc)
        result.checkpoint = str(checkpoint_path)
    dropped = _drop_partitions(store, before, limits)
    seen: dict[str, Any] = {"newest": None, "odd": bool(dropped)}
    result.deleted = dropped + _delete(store, limits, high, min(page, DELETE_PAGE), progress, started, seen)
    recount = getattr(store, "recount_after_prune", None)
    if recount is not None:  # the hourly totals of `audit stats` (`mrtr_keys.audit.writing.stores.hours`)
        recount(before, seen["newest"], seen["odd"])
    result.seconds = time.monotonic() - started
    return result


def _carried(docs: Sequence[dict[str, Any]], store: Any, cut_now: dict[str, Any]) -> list[dict[str, Any]]:
    """The cuts of earlier prunes recorded without a store id (before store ids; matched by URL) of
    chains this prune does not cut, recorded again under the store id so that `verify` still starts
    those chains there when the store is named another way (`mrtr_keys.audit.verifying.store_match`)."""
    if not getattr(store, "store_id", None):
        return []
    old, _ = prune_starts([d for d in docs if not d.get("store_id")])
    new, _ = prune_starts([d for d in docs if d.get("store_id")])
    return [
        {"writer": w, "seq": s.seq, "hash": s.hash, "time": s.time}
        for w, s in old.items()
        if w not in cut_now and (w not in new or new[w].seq < s.seq)
    ]


def _drop_partitions(store: Any, before: str, limits: dict[str, int]) -> int:
    """Whole day partitions entirely before the cut, dropped at once (PostgreSQL schemas 4 and 5)."""
    drop = getattr(store, "drop_partitions", None)
    return 0 if drop is None else int(drop(before, limits))


def _delete(
    store: Any,
    limits: dict[str, int],
    high: int,
    page: int,
    progress: Progress | None,
    started: float,
    seen: dict[str, Any],
) -> int:
    """Delete every record at or before its chain's limit among positions up to `high`; `seen`
    gets the newest deleted event time (``newest``) and whether any was `ODD` (``odd``)."""
    deleted = 0
    after = 0
    while after < high:
        rows = next(iter(store.row_batches(after, page)), None)
        if not rows:
            break
        rows = [r for r in rows if r[0] <= high]
        if not rows:
            break
        doomed = [r for r in rows if r[13] <= limits.get(r[12], 0)]
        for r in doomed:
            when = str(r[1])
            if seen["newest"] is None or when > seen["newest"]:
                seen["newest"] = when
            seen["odd"] = seen["odd"] or hour_of(when) == ODD
        doomed = [r[0] for r in doomed]
        last = int(rows[-1][0])
        if len(doomed) == len(rows):
            deleted += store.delete_positions(after, last)
        elif doomed:
            deleted += store.delete_positions(after, last, doomed)
        after = last
        if progress is not None:
            progress("delete", deleted, time.monotonic() - started)
    return deleted


@contextmanager
def pruner_lock(checkpoints: str | os.PathLike[str]) -> Iterator[bool]:
    """Hold the exclusive lock file ``CHECKPOINTS.lock`` (`flock`, released on exit or process
    death) while a prune or archive reads and appends `checkpoints`; yields False at once if another
    process of this host holds it. Two runs that overlapped recorded their cuts and manifests out of
    order (the older archive's reference last), which left the archive unverifiable.

    Raises:
        AuditError: the lock file cannot be created.
    """
    lock = _lock_path(checkpoints)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise AuditError(f"cannot open {lock}: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def pruner_running(checkpoints: str | os.PathLike[str]) -> bool:
    """Whether a prune or archive of `checkpoints` holds `pruner_lock` now; probed with a shared lock
    on the existing lock file only (nothing is created, so a read-only location is fine)."""
    try:
        fd = os.open(_lock_path(checkpoints), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # no lock file: no prune or archive has run beside this file
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def _lock_path(checkpoints: str | os.PathLike[str]) -> Path:
    path = Path(checkpoints)
    return path.with_name(path.name + ".lock")
