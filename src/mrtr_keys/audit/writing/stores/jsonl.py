"""`jsonl:///PATH`: the audit log as JSON lines, for log shippers; the CLI reads it too.

One record a line: the event fields, then ``writer``, ``seq``, ``prev_hash``, ``hash`` (the
format ``mrtr-keys audit export --format jsonl`` writes, so an export verifies like a store).
A batch is one ``write`` on an ``O_APPEND`` descriptor under an exclusive ``flock``, so
processes appending at once never interleave lines; a last line a failed write left incomplete is
cut off before the next append (the writer then re-sends what the store does not hold, issue 22).
The file is created mode 0600. Queries scan the file (fine for what a shipper keeps locally; use
SQLite or PostgreSQL to query a lot).
The schema version is the first line's ``{"schema_version": N}``. Presence rows (one an instance,
replaced by each heartbeat) live beside it in ``PATH.instances.json``, and ``key_usage`` rows
(`mrtr_keys.audit.writing.stores.key_usage`) in ``PATH.usage.json``, each rewritten atomically under a lock file.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from mrtr_keys.audit.events import STATS_KEYS
from mrtr_keys.audit.writing.chain import Record
from mrtr_keys.audit.writing.stores.base import (
    AUTO_SCHEMA,
    INSTANCE_COLUMNS,
    SCHEMA_VERSION,
    SQL_COLUMNS,
    Query,
    record_row,
)
from mrtr_keys.audit.writing.stores.key_usage import USAGE_COLUMNS, UsageRow, settle_rows
from mrtr_keys.errors import AuditError, AuditUnavailable, ConfigError


class JSONLStore:
    """The audit log in one JSON-lines file."""

    store_id: str | None = None
    """No store id (a text log has no place for one): its checkpoints match by URL
    (`mrtr_keys.audit.verifying.store_match`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser().absolute()
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists() and not self.path.is_file():
                raise ConfigError(f"the audit store {self.path} is not a regular file (jsonl:///PATH names a file)")
            # O_NONBLOCK: a FIFO swapped in after that look fails the open (ENXIO) instead of waiting for a reader
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ConfigError(f"the audit store {self.path} is not a regular file (jsonl:///PATH names a file)")
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_size == 0:
                    os.write(fd, (json.dumps({"schema_version": AUTO_SCHEMA}) + "\n").encode())  # 4 changed SQL only
            finally:
                os.close(fd)
        except OSError as exc:
            raise AuditUnavailable(f"cannot open the audit store {self.path}: {exc.strerror}") from None
        version = self.schema_version()
        if version > SCHEMA_VERSION:
            raise ConfigError(f"{self.path} has audit schema version {version}; upgrade mrtr-keys")

    @property
    def url(self) -> str:
        return "jsonl:///" + str(self.path).lstrip("/")

    def __repr__(self) -> str:
        return f"JSONLStore({str(self.path)!r})"

    def schema_version(self) -> int:
        with self.path.open(encoding="utf-8") as f:
            first = f.readline()
        try:
            doc = json.loads(first)
            return int(doc["schema_version"])
        except (ValueError, KeyError, TypeError, RecursionError):
            return SCHEMA_VERSION  # a bare export: records only

    def append_rows(self, rows: Sequence[tuple[object, ...]]) -> None:
        if not rows:
            return
        dumps = json.JSONEncoder(separators=(",", ":")).encode
        data = "".join(dumps(dict(zip(SQL_COLUMNS, row, strict=True))) + "\n" for row in rows).encode()
        with self._lock:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    _cut_torn_tail(fd)
                    view = memoryview(data)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                finally:
                    os.close(fd)
            except OSError as exc:
                raise AuditUnavailable(f"cannot write to the audit store {self.path}: {exc.strerror}") from None

    def records(self) -> Iterator[Record]:
        try:
            f = self.path.open(encoding="utf-8")
        except OSError as exc:
            raise AuditUnavailable(f"cannot read the audit store {self.path}: {exc.strerror}") from None
        with f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if not line.endswith("\n"):
                    return  # a last line cut short by a failed write: not stored (cut off at the next append)
                try:
                    doc = json.loads(line)
                    if "schema_version" in doc and "writer" not in doc:
                        continue
                    yield Record.from_json(doc, position=n)
                except (ValueError, KeyError, TypeError, RecursionError):
                    raise AuditError(f"{self.path}:{n}: not an audit record") from None

    def query(self, q: Query) -> list[Record]:
        out = [r for r in self.records() if q.matches(r)]
        if q.newest_first:
            out.reverse()
        return out[: q.limit] if q.limit is not None else out

    def iter_query(self, q: Query) -> Iterator[Record]:
        """`query` as a stream (oldest first without a limit: read as the file is read)."""
        if q.newest_first or q.limit is not None:
            yield from self.query(q)
            return
        for r in self.records():
            if q.matches(r):
                yield r

    def count(self) -> int:
        return sum(1 for _ in self.records())

    def row_batches(self, after: int = 0, size: int = 20_000) -> Iterator[list[tuple[object, ...]]]:
        """Rows (line number, then `SQL_COLUMNS`) of the lines after line `after`, `size` at a time."""
        batch: list[tuple[object, ...]] = []
        for r in self.records():
            if r.position > after:
                batch.append((r.position, *record_row(r)))
                if len(batch) >= size:
                    yield batch
                    batch = []
        if batch:
            yield batch

    def position_of(self, writer: str, seq: int, time: str) -> int | None:
        """The line of record `seq` of chain `writer` with event time `time`, or None."""
        for r in self.records():
            if r.writer == writer and r.seq == seq and r.event.time == time:
                return r.position
        return None

    def chain_length(self, writer: str, since: str) -> int:
        return max((r.seq for r in self.records() if r.writer == writer and r.event.time >= since), default=0)

    def stats(self, by: str, q: Query) -> list[tuple[str | None, int]]:
        if by not in STATS_KEYS:
            raise ConfigError(f"--by must be one of {', '.join(STATS_KEYS)}")
        counts: dict[str | None, int] = {}
        for r in self.records():
            if q.matches(r):
                key = getattr(r.event, by)
                counts[key] = counts.get(key, 0) + 1
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0] or ""))

    @property
    def _instances_path(self) -> Path:
        return self.path.with_name(self.path.name + ".instances.json")

    def put_instance(self, row: Sequence[object]) -> None:
        doc = dict(zip(INSTANCE_COLUMNS, row, strict=True))

        def change(rows: dict[str, dict[str, object]]) -> None:
            rows[str(doc["name"])] = doc

        self._rewrite(self._instances_path, change)

    def _rewrite(self, path: Path, change: Callable[[dict[str, dict[str, object]]], object]) -> None:
        """Read the JSON object at `path`, `change` it, and replace the file atomically, under its lock file."""
        with self._lock:
            try:
                fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    rows = self._read_doc(path)
                    change(rows)
                    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                    tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(tfd, "w", encoding="utf-8") as f:
                        json.dump(rows, f, separators=(",", ":"))
                    os.replace(tmp, path)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise AuditUnavailable(f"cannot write to the audit store {path}: {exc.strerror}") from None

    @staticmethod
    def _read_doc(path: Path) -> dict[str, dict[str, object]]:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise AuditUnavailable(f"cannot read the audit store {path}: {exc.strerror}") from None
        except (ValueError, RecursionError) as exc:  # not JSON: a damaged file, not an outage (exit 1, not 75)
            raise AuditError(f"cannot read the audit store {path}: {exc}") from None
        return doc if isinstance(doc, dict) else {}

    def instances(self) -> list[tuple[object, ...]]:
        rows = self._read_doc(self._instances_path)
        return [tuple(rows[k].get(c) for c in INSTANCE_COLUMNS) for k in sorted(rows)]

    @property
    def _usage_path(self) -> Path:
        return self.path.with_name(self.path.name + ".usage.json")

    def put_usage(self, rows: Sequence[UsageRow]) -> None:
        def change(doc: dict[str, dict[str, object]]) -> None:
            for r in rows:
                doc[f"{r.ring_id} {r.kid} {r.source}"] = dict(zip(USAGE_COLUMNS, r.row(), strict=True))

        if rows:
            self._rewrite(self._usage_path, change)

    def usage_rows(self, ring_id: str) -> list[UsageRow]:
        doc = self._read_doc(self._usage_path)
        try:
            rows = [UsageRow.from_row([v.get(c) for c in USAGE_COLUMNS]) for v in doc.values()]
        except (AttributeError, TypeError, ValueError) as exc:
            raise AuditError(f"cannot read the audit store {self._usage_path}: a malformed row ({exc})") from None
        return [r for r in rows if r.ring_id == ring_id]

    def settle_usage(self, ring_id: str, *, source: str | None = None, before: str | None = None) -> int:
        folded: list[int] = []

        def change(doc: dict[str, dict[str, object]]) -> None:
            rows = settle_rows(
                [UsageRow.from_row([v.get(c) for c in USAGE_COLUMNS]) for v in doc.values()], ring_id, source, before
            )
            if rows is None:
                return
            keep, gone = rows
            doc.clear()
            for r in keep:
                doc[f"{r.ring_id} {r.kid} {r.source}"] = dict(zip(USAGE_COLUMNS, r.row(), strict=True))
            folded.append(gone)

        self._rewrite(self._usage_path, change)
        return sum(folded)

    def close(self) -> None:
        pass


def _cut_torn_tail(fd: int) -> None:
    """Truncate the file after its last newline if its last line is incomplete (a write cut short)."""
    end = os.fstat(fd).st_size
    if end == 0 or os.pread(fd, 1, end - 1) == b"\n":
        return
    pos = end
    while pos > 0:
        start = max(0, pos - 65536)
        chunk = os.pread(fd, pos - start, start)
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            os.ftruncate(fd, start + cut + 1)
            return
        pos = start
    os.ftruncate(fd, 0)
