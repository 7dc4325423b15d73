"""The presence store's ``key_usage`` table: what each instance has sealed, unsealed and rejected per kid.

One row a (``ring_id``, ``kid``, ``source``), where a source is one process of one instance (``NAME#RANDOM``:
a restart under the same name is a new source, so no process ever overwrites another's counts). Only its
own process writes a row, always whole (absolute values, so a retry after an unknown outcome is harmless):

* ``seals``: what the fleet-wide total adds up; never below the seals the process made with the kid (it
  reserves ahead, at most ``block`` above them, `mrtr_keys.fleet.usage`), exact after a clean stop;
* ``sealed``, ``unseals``, ``rejections``: the process's exact counts when it last wrote;
* ``block``: the reservation in force (``seals - sealed <= block``); ``updated`` (event time string) and
  ``state`` (``running``, ``stopped``).

The fleet-wide total of a kid is the sum over its rows (`totals`). Rows of sources that stopped, or that
have not written for a long while, are settled into the kid's one ``SETTLED`` row (`SQLKeyUsage.settle_usage`),
their counts added as they stand (a killed process's reservation included: never below the truth, and its
``block`` too, so ``seals - block`` stays a count that was true), so the table stays about as small as the
fleet. The table is created on any open that lacks it (like ``store_meta``): it needs no schema version, and
releases before it ignore it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

USAGE_COLUMNS = (
    "ring_id",
    "kid",
    "source",
    "instance",
    "seals",
    "sealed",
    "unseals",
    "rejections",
    "block",
    "updated",
    "state",
)
"""Columns of ``key_usage``, in the order `UsageRow.row` gives them."""
RUNNING, STOPPED = "running", "stopped"
"""``state`` of a source's rows: still counting, or stopped cleanly (its counts exact)."""
SETTLED = "(settled)"
"""The ``source`` of a kid's row that holds the counts of every settled source."""
_COUNTS = ("seals", "sealed", "unseals", "rejections")


def table_ddl() -> str:
    """The table (SQLite and PostgreSQL alike)."""
    return (
        "CREATE TABLE IF NOT EXISTS key_usage (ring_id TEXT NOT NULL, kid TEXT NOT NULL, source TEXT NOT NULL, "
        "instance TEXT NOT NULL, seals BIGINT NOT NULL, sealed BIGINT NOT NULL, unseals BIGINT NOT NULL, "
        "rejections BIGINT NOT NULL, block BIGINT NOT NULL, updated TEXT NOT NULL, state TEXT NOT NULL, "
        "PRIMARY KEY (ring_id, kid, source))"
    )


@dataclass(frozen=True)
class UsageRow:
    """One row of ``key_usage`` (see the module docstring)."""

    ring_id: str
    kid: str
    source: str
    instance: str
    seals: int
    sealed: int
    unseals: int
    rejections: int
    block: int
    updated: str
    state: str

    def row(self) -> tuple[object, ...]:
        return tuple(getattr(self, c) for c in USAGE_COLUMNS)

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> UsageRow:
        ring_id, kid, source, instance, seals, sealed, unseals, rejections, block, updated, state = row
        return cls(
            str(ring_id),
            str(kid),
            str(source),
            str(instance),
            int(seals),
            int(sealed),
            int(unseals),
            int(rejections),
            int(block),
            str(updated),
            str(state),
        )


@dataclass(frozen=True)
class KidTotals:
    """A kid's fleet-wide counts: the sum of its rows."""

    kid: str
    seals: int
    """Never below the seals made with the kid: reservations included (at most ``blocks`` above)."""
    sealed: int
    """The exact seals the rows last reported."""
    unseals: int
    rejections: int
    blocks: int
    """The sum of the reservations in force: ``seals - blocks`` is at most the true count."""
    sources: int


def totals(rows: Iterable[UsageRow]) -> dict[str, KidTotals]:
    """Kid -> `KidTotals` over `rows` (one ring's)."""
    acc: dict[str, list[int]] = {}
    for r in rows:
        a = acc.setdefault(r.kid, [0, 0, 0, 0, 0, 0])
        for i, v in enumerate((r.seals, r.sealed, r.unseals, r.rejections, r.block, 1)):
            a[i] += v
    return {kid: KidTotals(kid, *a) for kid, a in acc.items()}


def settle_rows(
    rows: Sequence[UsageRow], ring_id: str, source: str | None, before: str | None
) -> tuple[list[UsageRow], int] | None:
    """`SQLKeyUsage.settle_usage` on rows in memory (the JSON-lines store): (rows kept, with the settled rows
    updated, and how many were folded), or None when nothing is to be folded."""

    def folds(r: UsageRow) -> bool:
        if r.ring_id != ring_id or r.source == SETTLED:
            return False
        return (source is not None and r.source == source) or (before is not None and r.updated < before)

    gone = [r for r in rows if folds(r)]
    if not gone:
        return None
    keep = {(r.ring_id, r.kid, r.source): r for r in rows if not folds(r)}
    for r in gone:
        old = keep.get((ring_id, r.kid, SETTLED))
        base = old or UsageRow(ring_id, r.kid, SETTLED, SETTLED, 0, 0, 0, 0, 0, r.updated, STOPPED)
        keep[(ring_id, r.kid, SETTLED)] = UsageRow(
            ring_id,
            r.kid,
            SETTLED,
            SETTLED,
            base.seals + r.seals,
            base.sealed + r.sealed,
            base.unseals + r.unseals,
            base.rejections + r.rejections,
            base.block + r.seals - r.sealed,
            max(base.updated, r.updated),
            STOPPED,
        )
    return list(keep.values()), len(gone)


class SQLKeyUsage:
    """Mixin of `mrtr_keys.audit.writing.stores.sql.SQLStore`: ``key_usage`` reads and writes."""

    PARAM: str

    def _transaction(self, verb: str) -> Any:
        raise NotImplementedError

    def _begin(self, cur: Any) -> None:
        raise NotImplementedError

    def _fetch(self, sql: str, args: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def _make_usage(self, cur: Any) -> None:
        """Create ``key_usage`` if missing (inside the schema transaction on open)."""
        cur.execute(table_ddl())

    def put_usage(self, rows: Sequence[UsageRow]) -> None:
        """Insert or replace `rows` (whole rows, keyed by ring, kid and source), in one transaction.

        Raises:
            AuditError: the store cannot be written.
        """
        if not rows:
            return
        p = self.PARAM
        cols = ", ".join(USAGE_COLUMNS)
        updates = ", ".join(f"{c} = excluded.{c}" for c in USAGE_COLUMNS[3:])
        sql = (
            f"INSERT INTO key_usage ({cols}) VALUES ({', '.join([p] * len(USAGE_COLUMNS))}) "  # noqa: S608 - fixed names
            f"ON CONFLICT (ring_id, kid, source) DO UPDATE SET {updates}"
        )
        with self._transaction("write to") as cur:
            self._begin(cur)
            cur.executemany(sql, [r.row() for r in rows])

    def usage_rows(self, ring_id: str) -> list[UsageRow]:
        """Every ``key_usage`` row of ring `ring_id`.

        Raises:
            AuditError: the store cannot be read.
        """
        sql = f"SELECT {', '.join(USAGE_COLUMNS)} FROM key_usage WHERE ring_id = {self.PARAM}"  # noqa: S608
        return [UsageRow.from_row(r) for r in self._fetch(sql, [ring_id])]

    def settle_usage(self, ring_id: str, *, source: str | None = None, before: str | None = None) -> int:
        """Add the rows of `source` (and of every source whose last write is older than `before`, an event
        time string) to their kid's `SETTLED` row and delete them, in one transaction; returns how many.
        Concurrent settles never count a row twice (each takes only the rows it deleted).

        Raises:
            AuditError: the store cannot be written.
        """
        p = self.PARAM
        clauses = [f"source = {p}"] if source is not None else []
        args: list[Any] = [source] if source is not None else []
        if before is not None:
            clauses.append(f"updated < {p}")
            args.append(before)
        if not clauses:
            return 0
        where = f"ring_id = {p} AND source <> {p} AND ({' OR '.join(clauses)})"
        with self._transaction("write to") as cur:
            self._begin(cur)
            cur.execute(
                f"DELETE FROM key_usage WHERE {where} RETURNING kid, seals, sealed, unseals, rejections, updated",  # noqa: S608
                (ring_id, SETTLED, *args),
            )
            gone = cur.fetchall()
            merged: dict[str, list[Any]] = {}
            for kid, *counts, updated in gone:
                m = merged.setdefault(str(kid), [0, 0, 0, 0, ""])
                for i, v in enumerate(counts):
                    m[i] += int(v)
                m[4] = max(m[4], str(updated))
            adds = ", ".join(f"{c} = key_usage.{c} + excluded.{c}" for c in (*_COUNTS, "block"))
            sql = (
                f"INSERT INTO key_usage ({', '.join(USAGE_COLUMNS)}) "  # noqa: S608 - fixed names
                f"VALUES ({', '.join([p] * len(USAGE_COLUMNS))}) "
                f"ON CONFLICT (ring_id, kid, source) DO UPDATE SET {adds}, updated = excluded.updated"
            )
            for kid, (seals, sealed, unseals, rejections, updated) in merged.items():
                block = seals - sealed  # a killed process's unused reservation: still at most this above the truth
                row = UsageRow(
                    ring_id, kid, SETTLED, SETTLED, seals, sealed, unseals, rejections, block, updated, STOPPED
                )
                cur.execute(sql, row.row())
            return len(gone)
