"""PostgreSQL schemas 4 and 5: ``audit_events`` partitioned by day on the event time (issues 26 and 41).

Layout: ``audit_events`` is a range-partitioned table on ``time`` (``TEXT COLLATE "C"``: event times
are fixed-width ISO 8601 strings, `mrtr_keys.audit.events.format_ts`, so byte order is time order);
one partition a UTC day, named ``audit_events_pYYYYMMDD`` and covering ``['YYYY-MM-DD',
'YYYY-MM-DD'+1)``; ``audit_events_default`` takes a row no day partition covers (a time that is not
ISO 8601, or a day whose partition could not be created), so an append never fails for want of a
partition. The primary key is ``(id, time)``: PostgreSQL requires every unique constraint of a
partitioned table to include the partition key (docs: "5.11.2.3. Limitations"); ``id`` alone still
comes from one sequence, so storage order is unchanged.

Partitions are created `AHEAD_DAYS` ahead by the writer (and on open), and on demand for the days of
the rows being appended (a day rolling over, a back-dated event); `PostgresStore.drop_partitions`
drops whole partitions a prune has cut past. Existing (schema 3 or 4) stores are converted to 5 by
``mrtr-keys audit migrate`` (`v5_statements`), which copies every row with its ``id``.

Indexes: ``time`` (windows, the promote gate, ``chain_length``), ``(kid, op, time)`` (``--kid`` alone,
the rotation gates) and a hash index on ``fingerprint`` (``query --token``: 4-byte hash codes, far
narrower than a B-tree of 24-character keys).

Schema 5 (issue 41; ``mrtr-keys audit migrate`` from 3 or 4) keeps the partitions and narrows the row to
what `mrtr_keys.audit.writing.stores.narrow` stores in SQLite: ``time`` is BIGINT microseconds since the epoch (the
partition key: a day is ``[midnight, next midnight)`` in microseconds), ``instance`` and ``writer`` are
INTEGER ids of ``audit_names``, ``fingerprint`` is BYTEA (12 bytes). A value that is not in the canonical
form (only a hand edit holds one) is kept exactly in ``time_text`` / ``fingerprint_text`` with NULL in the
narrow column: such a row lands in the default partition, reads back unchanged and is matched by no time
window (its hour key is ``?``). Fixed-width columns come first (no alignment padding). The primary key
(which would have to repeat ``time``) becomes a plain index on ``id``. About 250 bytes an event in all at
1 M events against 483 for schema 4 (docs/audit.md).
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta

AHEAD_DAYS = 2
"""Day partitions kept ready after today (UTC): a writer never creates one at midnight under load."""
PREFIX = "audit_events_p"
DEFAULT_PARTITION = "audit_events_default"
PARTITION_LOCK_TIMEOUT_MS = 1_000
"""Most milliseconds creating or dropping a partition waits for the parent table's lock (a long
reader holds it): past that the step is skipped and tried again later, never queuing writers."""

_DAY = re.compile(r"(\d{4})-(\d{2})-(\d{2})")
_NAME = re.compile(re.escape(PREFIX) + r"(\d{8})")

COLUMNS_DDL = """
    id BIGINT NOT NULL DEFAULT nextval('audit_events_id_seq'),
    time TEXT COLLATE "C" NOT NULL,
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
    hash TEXT NOT NULL,
    PRIMARY KEY (id, time)"""

INDEXES = (
    "CREATE INDEX audit_events_time ON audit_events (time)",
    "CREATE INDEX audit_events_kid_op_time ON audit_events (kid, op, time)",
    "CREATE INDEX audit_events_fingerprint ON audit_events USING hash (fingerprint)",
)

LIST_PARTITIONS = (
    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
    "WHERE i.inhparent = 'audit_events'::regclass"
)


def day_of(time: str) -> date | None:
    """The UTC day of an event time string, or None if it does not start with ``YYYY-MM-DD``."""
    m = _DAY.match(time)
    if m is None:
        return None
    try:
        return date(int(m[1]), int(m[2]), int(m[3]))
    except ValueError:
        return None


def partition_name(day: date) -> str:
    """``audit_events_pYYYYMMDD``."""
    return f"{PREFIX}{day:%Y%m%d}"


def day_of_partition(name: str) -> date | None:
    """The day a partition named by `partition_name` covers, or None for another table."""
    m = _NAME.fullmatch(name)
    return None if m is None else datetime.strptime(m[1], "%Y%m%d").replace(tzinfo=UTC).date()


def create_partition(day: date) -> str:
    """DDL creating the partition of `day` (``IF NOT EXISTS``: callers hold the schema lock)."""
    nxt = day + timedelta(days=1)
    return (
        f"CREATE TABLE IF NOT EXISTS {partition_name(day)} PARTITION OF audit_events "
        f"FOR VALUES FROM ('{day.isoformat()}') TO ('{nxt.isoformat()}')"
    )


def days_ahead(now: float, ahead: int = AHEAD_DAYS) -> set[date]:
    """Today (UTC, at `now` in Unix seconds) and the `ahead` days after it."""
    today = datetime.fromtimestamp(now, UTC).date()
    return {today + timedelta(days=i) for i in range(ahead + 1)}


OLD_DAYS = "SELECT DISTINCT left(time, 10) FROM audit_events"
"""The days a schema 3 or 4 table's rows cover (run before `v5_statements`)."""
NEW_COUNT = "SELECT COUNT(*) FROM audit_events"


V5_COLUMNS = (
    "id",
    "time",
    "seq",
    "generation",
    "duration_ms",
    "instance",
    "writer",
    "client",
    "audience",
    "kid",
    "op",
    "outcome",
    "reason",
    "fingerprint",
    "prev_hash",
    "hash",
    "time_text",
    "fingerprint_text",
)
"""Schema 5's columns in table order (``id`` from the sequence)."""
V5_DDL = """
    id BIGINT NOT NULL DEFAULT nextval('audit_events_id_seq'),
    time BIGINT,
    seq BIGINT NOT NULL,
    generation BIGINT,
    duration_ms DOUBLE PRECISION,
    instance INTEGER NOT NULL,
    writer INTEGER NOT NULL,
    client TEXT,
    audience TEXT,
    kid TEXT,
    op TEXT NOT NULL,
    outcome TEXT NOT NULL,
    reason TEXT,
    fingerprint BYTEA,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL,
    time_text TEXT,
    fingerprint_text TEXT"""
V5_INDEXES = (
    "CREATE INDEX audit_events_id ON audit_events (id)",
    "CREATE INDEX audit_events_time ON audit_events (time)",
    "CREATE INDEX audit_events_kid_op_time ON audit_events (kid, op, time)",
    "CREATE INDEX audit_events_fingerprint ON audit_events USING hash (fingerprint)",
)
NAMES = (
    "CREATE TABLE IF NOT EXISTS audit_names "
    "(id INTEGER GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, name TEXT NOT NULL UNIQUE)"
)
DAY_US = 86_400_000_000


def create_partition_v5(day: date) -> str:
    """DDL creating the schema-5 partition of `day` (bounds in microseconds since the epoch)."""
    start = (day - date(1970, 1, 1)).days * DAY_US
    return (
        f"CREATE TABLE IF NOT EXISTS {partition_name(day)} PARTITION OF audit_events "
        f"FOR VALUES FROM ({start}) TO ({start + DAY_US})"
    )


def v5_statements(days: set[date], old_partitions: list[str]) -> list[str]:
    """The schema-5 table made beside the old one (schema 3, or 4 with `old_partitions`), which is renamed
    ``audit_events_old`` (its partitions ``..._old``) until the caller has copied and counted the rows."""
    renames = [f"ALTER TABLE {name} RENAME TO {name}_old" for name in old_partitions]
    return [
        "ALTER TABLE audit_events RENAME TO audit_events_old",
        *renames,
        "ALTER TABLE audit_events_old DROP CONSTRAINT IF EXISTS audit_events_pkey",
        *(f"DROP INDEX IF EXISTS {name}" for name in ("audit_events_time", "audit_events_op_kid_time")),
        *(f"DROP INDEX IF EXISTS {name}" for name in ("audit_events_kid_op_time", "audit_events_fingerprint")),
        "ALTER SEQUENCE audit_events_id_seq OWNED BY NONE",
        f"CREATE TABLE audit_events ({V5_DDL}\n) PARTITION BY RANGE (time)",
        "ALTER SEQUENCE audit_events_id_seq OWNED BY audit_events.id",
        f"CREATE TABLE {DEFAULT_PARTITION} PARTITION OF audit_events DEFAULT",
        *(create_partition_v5(d) for d in sorted(days)),
        NAMES,
    ]


DROP_OLD_V5 = "DROP TABLE audit_events_old"
