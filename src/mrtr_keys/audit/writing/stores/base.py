"""The store contract every audit backend (SQLite, PostgreSQL, JSONL) implements, and the query shape."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from mrtr_keys.audit.events import FIELDS
from mrtr_keys.audit.writing.chain import Record, event_values
from mrtr_keys.audit.writing.stores.key_usage import UsageRow

SCHEMA_VERSION = 5
"""The schema this code creates. A new store is created at it; an existing store is migrated on open
up to `AUTO_SCHEMA` (cheap steps, `SQL_MIGRATIONS`), and to 4 or 5 only by ``mrtr-keys audit migrate``
(it rewrites the table on PostgreSQL: `mrtr_keys.audit.writing.stores.pg_layout`; SQLite 4 -> 5 replaces one index:
`mrtr_keys.audit.writing.stores.narrow`; docs/audit.md). This code reads and writes stores at 3, 4 and 5, and refuses
a newer one."""
AUTO_SCHEMA = 3
"""The highest schema version an existing store is migrated to on open."""

FILTER_FIELDS = ("kid", "audience", "op", "outcome", "reason", "client", "instance", "fingerprint")


@dataclass(frozen=True)
class Query:
    """A filter over events. Times are event time strings (`mrtr_keys.audit.events.format_ts`).

    `since` is inclusive, `until` exclusive; `after_position` skips records up to that storage
    position (for ``tail -f``); `limit` with `newest_first` gives the newest N.
    """

    since: str | None = None
    until: str | None = None
    kid: str | None = None
    audience: str | None = None
    op: str | None = None
    outcome: str | None = None
    reason: str | None = None
    client: str | None = None
    instance: str | None = None
    fingerprint: str | None = None
    after_position: int = 0
    limit: int | None = None
    newest_first: bool = False

    def filters(self) -> dict[str, str]:
        """The equality filters that are set."""
        return {f: v for f in FILTER_FIELDS if (v := getattr(self, f)) is not None}

    def matches(self, r: Record) -> bool:
        """True if `r` passes every filter (the JSONL store's in-memory evaluation)."""
        ev = r.event
        if r.position <= self.after_position:
            return False
        if self.since is not None and ev.time < self.since:
            return False
        if self.until is not None and ev.time >= self.until:
            return False
        return all(getattr(ev, f) == v for f, v in self.filters().items())


class AuditStore(Protocol):
    """Where audit records live. Implementations are thread-safe."""

    @property
    def url(self) -> str:
        """The store's URL with any password removed."""
        ...

    @property
    def store_id(self) -> str | None:
        """The store's random id, made with the store and kept in it (SQL stores: table
        ``store_meta``); None for a JSON-lines log. Checkpoints are matched by it
        (`mrtr_keys.audit.verifying.store_match`)."""
        ...

    def append_rows(self, rows: Sequence[tuple[object, ...]]) -> None:
        """Store rows (values in `SQL_COLUMNS` order, as `ChainWriter.link_values` makes them) in
        order, atomically (all or none).

        Raises:
            AuditError: the store cannot be written.
        """
        ...

    def query(self, q: Query) -> list[Record]:
        """Matching records, oldest first (or newest first with `q.newest_first`)."""
        ...

    def iter_query(self, q: Query) -> Iterator[Record]:
        """`query` as a stream: records are read as they are consumed (flat memory at any result size)."""
        ...

    def records(self) -> Iterator[Record]:
        """Every record in storage order (for verify, checkpoint and export)."""
        ...

    def count(self) -> int:
        """How many records the store holds."""
        ...

    def row_batches(self, after: int = 0, size: int = 20_000) -> Iterator[list[tuple[object, ...]]]:
        """Every record after storage position `after` as raw rows (position, then `SQL_COLUMNS`
        values), in storage order, at most `size` a list (streaming `verify`: bounded memory)."""
        ...

    def position_of(self, writer: str, seq: int, time: str) -> int | None:
        """The storage position of record `seq` of chain `writer` with event time `time`, or None."""
        ...

    def chain_length(self, writer: str, since: str) -> int:
        """The highest ``seq`` stored on chain `writer` among records whose time is at or after
        `since` (an event time string), 0 if none: how many events that writer has stored, when
        `since` is no later than the time of its newest stored event (a chain's seqs are 1, 2, 3,
        ... with no gap, `mrtr_keys.audit.writing.chain`). A writer process's parent asks this when the
        process died, to count exactly what it lost (`mrtr_keys.audit.writing.writer.child_writer`).

        Raises:
            AuditError: the store cannot be read.
        """
        ...

    def stats(self, by: str, q: Query) -> list[tuple[str | None, int]]:
        """(value of `by`, count) for records matching `q`, most frequent first."""
        ...

    def put_instance(self, row: Sequence[object]) -> None:
        """Insert or replace the presence row of one instance (values in `INSTANCE_COLUMNS` order,
        keyed by ``name``; see `mrtr_keys.fleet.presence`).

        Raises:
            AuditError: the store cannot be written.
        """
        ...

    def instances(self) -> list[tuple[object, ...]]:
        """Every presence row, in `INSTANCE_COLUMNS` order."""
        ...

    def put_usage(self, rows: Sequence[UsageRow]) -> None:
        """Insert or replace whole ``key_usage`` rows (keyed by ring, kid and source), atomically
        (`mrtr_keys.audit.writing.stores.key_usage`; written by `mrtr_keys.fleet.usage`).

        Raises:
            AuditError: the store cannot be written.
        """
        ...

    def usage_rows(self, ring_id: str) -> list[UsageRow]:
        """Every ``key_usage`` row of ring `ring_id` (`mrtr_keys.audit.writing.stores.key_usage.totals` sums them).

        Raises:
            AuditError: the store cannot be read.
        """
        ...

    def settle_usage(self, ring_id: str, *, source: str | None = None, before: str | None = None) -> int:
        """Fold the rows of `source`, and of sources silent since `before`, into each kid's settled row;
        returns how many rows were folded.

        Raises:
            AuditError: the store cannot be written.
        """
        ...

    def close(self) -> None: ...


INSTANCE_COLUMNS = (
    "name",
    "host",
    "pid",
    "kind",
    "codec",
    "ring_id",
    "generation",
    "primary_kid",
    "version",
    "started",
    "beat",
    "every_s",
    "state",
    "note",
)
"""Columns of the presence table ``instances``: one row an instance name, replaced by every heartbeat."""

SQL_COLUMNS = (*FIELDS, "writer", "seq", "prev_hash", "hash")
"""Stored columns: the event's `FIELDS`, then its place in its writer's hash chain."""

SQL_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE audit_events (
            id {autoinc},
            time TEXT NOT NULL,
            instance TEXT NOT NULL,
            client TEXT,
            audience TEXT,
            kid TEXT,
            op TEXT NOT NULL,
            outcome TEXT NOT NULL,
            reason TEXT,
            fingerprint TEXT,
            generation BIGINT,
            duration_ms DOUBLE PRECISION,
            writer TEXT NOT NULL,
            seq BIGINT NOT NULL,
            prev_hash TEXT NOT NULL,
            hash TEXT NOT NULL
        )""",
        "CREATE INDEX audit_events_time ON audit_events (time)",
        "CREATE INDEX audit_events_kid_time ON audit_events (kid, time)",
        "CREATE INDEX audit_events_op_time ON audit_events (op, time)",
        "CREATE INDEX audit_events_fingerprint ON audit_events (fingerprint)",
    ),
    # v2: only the indexes the queries need, since every index costs each insert (the fingerprint
    # index, random keys, cost more than the row itself). Kept: `time` (every --since/--until,
    # the promote gate's window); new: (op, kid, time) for the rotation gates (op=seal + kid +
    # time for retire, op=begin + kid, op=ring-loaded for promote) and `--op`/`--kid` queries.
    # Other filters (`--token`'s fingerprint, --client, ...) scan, within `--since` if given.
    2: (
        "DROP INDEX IF EXISTS audit_events_fingerprint",
        "DROP INDEX IF EXISTS audit_events_kid_time",
        "DROP INDEX IF EXISTS audit_events_op_time",
        "CREATE INDEX audit_events_op_kid_time ON audit_events (op, kid, time)",
    ),
    # v3: presence (`mrtr_keys.fleet.presence`): one row an instance, replaced by each heartbeat.
    3: (
        """CREATE TABLE instances (
            name TEXT PRIMARY KEY,
            host TEXT,
            pid BIGINT,
            kind TEXT,
            codec TEXT,
            ring_id TEXT,
            generation BIGINT,
            primary_kid TEXT,
            version TEXT,
            started TEXT NOT NULL,
            beat TEXT NOT NULL,
            every_s DOUBLE PRECISION NOT NULL,
            state TEXT NOT NULL,
            note TEXT
        )""",
    ),
}
"""The one SQL schema (SQLite and PostgreSQL), as numbered migrations; ``schema_version`` holds the
number applied. ``{autoinc}`` is each dialect's auto-increment primary key. A store at an older
version is migrated on open, in one transaction (PostgreSQL: under an advisory lock)."""


_WRITER, _SEQ = SQL_COLUMNS.index("writer"), SQL_COLUMNS.index("seq")


def stored_prefix(store: AuditStore, rows: Sequence[tuple[object, ...]]) -> int:
    """How many of `rows` (one linked transaction of one chain, in seq order, as `append_rows` was
    given them) `store` holds already: 0 (the append did not land), ``len(rows)`` (it did), or, for a
    store whose appends are not atomic on every failure (a JSONL write cut short), a leading part.

    A writer that re-sends a transaction after an error (a cut connection may lose the answer to a
    commit the server applied) asks this first, so the transaction is stored exactly once: the
    store's own answer, from the chain's highest seq (`AuditStore.chain_length`) at or after the
    transaction's earliest event time, decides (issue 22).

    Raises:
        AuditError: the store cannot be read (the writer retries later, asking again).
    """
    if not rows:
        return 0
    first = rows[0][_SEQ]
    assert isinstance(first, int)
    since = min(str(r[0]) for r in rows)
    length = store.chain_length(str(rows[0][_WRITER]), since)
    return max(0, min(len(rows), length - first + 1))


def record_row(r: Record) -> tuple[object, ...]:
    """A `Record` as a row in `SQL_COLUMNS` order."""
    return (
        *event_values(r.event),
        r.writer,
        r.seq,
        r.prev_hash,
        r.hash,
    )
