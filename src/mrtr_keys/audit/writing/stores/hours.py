"""Hourly totals of the SQL stores, so ``audit stats`` never rescans the log (issue 26, deliver 5).

``audit_hours`` holds one row per UTC hour and combination of the fields ``stats`` groups or filters
on (`STATS_KEYS`): ``(hour, k, kid, reason, audience, client, instance, op, outcome, n)``, keyed by
``(hour, k)`` where ``k`` is the JSON array of the seven values (NULLs included, so the key is exact
in both dialects' unique constraints). ``hour`` is the first 13 characters of the event time
(``2026-07-28T10``) when the time starts ``YYYY-MM-DDTHH:``, else `ODD` (only a hand-edited store
holds such times). Hour keys compare as text exactly as the times they cover do, so the whole hours
of a window are a key range.

Kept exact by:

* **the writer**: `SQLStore.append_rows` adds each transaction's counts in that same transaction
  (`add`), so a transaction is counted if and only if it is stored; a resent transaction appends
  only what the store does not hold (`mrtr_keys.audit.writing.stores.base.stored_prefix`), and only that is
  added;
* **prune, retention, archive** (`mrtr_keys.audit.retention.prune`): after the deletes, `after_prune` drops
  every hour before the oldest kept event and recounts, from the kept rows, each hour from there up
  to the cut (the boundary hours), under a lock that makes writers of those hours wait;
* **existing stores** (created before the totals): the table is made on open with ``audit_hours_from
  (upto, done)``: rows at storage positions ``done < id <= upto`` (written before the table existed)
  are not counted yet. ``mrtr-keys audit migrate`` counts them in pages of `BACKFILL_PAGE` rows, each
  page in its own transaction that also advances ``done`` (resumable, flat memory). Until then
  ``stats`` counts by scanning, as before. A new store starts complete (``upto = 0``).

A row is "counted" when ``id > upto OR id <= done``; a recount counts only those, so prune and an
unfinished backfill never count a row twice.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from operator import itemgetter
from typing import Any

from mrtr_keys.audit.events import STATS_KEYS
from mrtr_keys.audit.writing.stores.base import SQL_COLUMNS

ODD = "?"
"""The hour key of an event time that does not start ``YYYY-MM-DDTHH:`` (sorts after every hour)."""
BACKFILL_PAGE = 20_000
"""Rows counted per transaction by `backfill`."""
_PREFIX = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:", re.ASCII)
_HOUR = re.compile(r"(\d{4}-\d{2}-\d{2}T\d{2}):00:00\.000000Z", re.ASCII)
_CANONICAL = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z", re.ASCII)
_TIME = SQL_COLUMNS.index("time")
_KEYS = tuple(SQL_COLUMNS.index(k) for k in STATS_KEYS)
COLUMNS = ("hour", "k", *STATS_KEYS, "n")


def table_ddl(text: str) -> tuple[str, str]:
    """The two tables (``text``: the dialect's byte-ordered text type)."""
    fields = ",\n    ".join(f"{k} {text}" for k in STATS_KEYS)
    return (
        f"CREATE TABLE IF NOT EXISTS audit_hours (\n    hour {text} NOT NULL,\n    k {text} NOT NULL,\n"
        f"    {fields},\n    n BIGINT NOT NULL,\n    PRIMARY KEY (hour, k)\n)",
        "CREATE TABLE IF NOT EXISTS audit_hours_from (upto BIGINT NOT NULL, done BIGINT NOT NULL)",
    )


def hour_of(time: object) -> str:
    """The hour key of an event time string (see the module docstring)."""
    return time[:13] if isinstance(time, str) and _PREFIX.match(time) else ODD


def tally(
    rows: Iterable[Sequence[Any]], time_col: int = _TIME, keys: Sequence[int] = _KEYS
) -> Counter[tuple[Any, ...]]:
    """``(hour, *STATS_KEYS values) -> count`` of `rows` (values as written; about 1 us a row: the
    writer calls it on every append)."""
    fields = itemgetter(*keys)
    by_prefix = Counter((r[time_col][:14] if r[time_col].__class__ is str else None, fields(r)) for r in rows)
    out: Counter[tuple[Any, ...]] = Counter()
    for (prefix, values), n in by_prefix.items():
        out[(hour_of(prefix), *values)] += n
    return out


def upsert_sql(param: str) -> str:
    """One row's ``INSERT ... ON CONFLICT (hour, k) DO UPDATE`` adding its ``n`` (SQLite >= 3.24,
    PostgreSQL >= 9.5); `param`: the dialect's placeholder."""
    marks = ", ".join([param] * len(COLUMNS))
    return (
        f"INSERT INTO audit_hours ({', '.join(COLUMNS)}) VALUES ({marks}) "  # noqa: S608 - fixed names
        "ON CONFLICT (hour, k) DO UPDATE SET n = audit_hours.n + excluded.n"
    )


def add(cur: Any, param: str, counts: Counter[tuple[Any, ...]]) -> None:
    """Add `counts` (from `tally`) to the totals, inside the caller's transaction."""
    if counts:
        # In one order (by key) in every writer, so two writers' upserts never deadlock.
        rows = [(key[0], json.dumps(key[1:]), *key[1:], n) for key, n in counts.items()]
        cur.executemany(upsert_sql(param), sorted(rows, key=lambda r: (r[0], r[1])))


def state(cur: Any) -> tuple[int, int]:
    """``(upto, done)`` (see the module docstring); (0, 0) if no row."""
    cur.execute("SELECT upto, done FROM audit_hours_from")
    row = cur.fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def next_hour(hour: str) -> str | None:
    """The hour key after `hour` (``2026-07-28T23`` -> ``2026-07-29T00``), None if not a real hour."""
    try:
        return (datetime.strptime(hour, "%Y-%m-%dT%H") + timedelta(hours=1)).strftime("%Y-%m-%dT%H")
    except ValueError:
        return None


def start_of(hour: str) -> str:
    """The first event time of an hour key (``2026-07-28T10`` -> ``2026-07-28T10:00:00.000000Z``)."""
    return hour + ":00:00.000000Z"


Window = tuple[str | None, str | None]


def split(since: str | None, until: str | None) -> tuple[list[Window], Window | None] | None:
    """A window ``[since, until)`` as (edge windows to scan, whole hours): the whole hours are the
    keys ``lo <= hour < hi`` (None: unbounded; no whole hours: None). None if a bound is not a
    canonical time (the caller scans the window instead)."""
    for bound in (since, until):
        if bound is not None and (not _CANONICAL.fullmatch(bound) or next_hour(bound[:13]) is None):
            return None
    lo = hi = None
    edges: list[Window] = []
    if since is not None:
        lo = since[:13] if _HOUR.fullmatch(since) else next_hour(since[:13])
        assert lo is not None
        if lo != since[:13]:
            edges.append((since, start_of(lo)))
    if until is not None:
        hi = until[:13]
        if not _HOUR.fullmatch(until):
            edges.append((start_of(hi), until))
    if lo is not None and hi is not None and lo >= hi:
        return [(since, until)], None  # inside one or two hours: scan it all
    return edges, (lo, hi)


RECOUNT = "recount the hourly totals of"
"""The transaction verb of a recount or a backfill page (a long transaction: the read deadline)."""


class HourTotals:
    """Mixin of `mrtr_keys.audit.writing.stores.sql.SQLStore`: ``stats`` from the totals, prune's recount,
    the backfill. A dialect may override `_hour_window`, `_odd_clause`, `_lock_hours`, `_raw_hours`."""

    PARAM: str
    HOUR_TEXT = "TEXT"

    # Supplied by SQLStore.
    def _transaction(self, verb: str) -> Any:
        raise NotImplementedError

    def _begin(self, cur: Any) -> None:
        raise NotImplementedError

    def _fetch(self, sql: str, args: Sequence[Any]) -> list[Any]:
        raise NotImplementedError

    def _scan_stats(self, by: str, q: Any) -> list[tuple[Any, int]]:
        raise NotImplementedError

    def _make_hours(self, cur: Any) -> None:
        """Create the totals on open (inside the schema transaction): complete for an empty store;
        for one with events, counted from the next position on (``audit migrate`` counts the rest)."""
        for stmt in table_ddl(self.HOUR_TEXT):
            cur.execute(stmt)
        cur.execute("SELECT COUNT(*) FROM audit_hours_from")
        if int(cur.fetchone()[0]) == 0:
            cur.execute("SELECT MAX(id) FROM audit_events")
            top = cur.fetchone()[0]
            cur.execute(f"INSERT INTO audit_hours_from (upto, done) VALUES ({self.PARAM}, 0)", (int(top or 0),))  # noqa: S608

    # Dialect hooks.
    def _hour_window(self, hour: str) -> tuple[str, list[Any]]:
        """The clause selecting the events whose time has hour key `hour` (not `ODD`)."""
        p = self.PARAM
        return f"time >= {p} AND time < {p}", [hour + ":", hour + ";"]

    def _odd_clause(self) -> str:
        """The clause selecting the events whose hour key is `ODD`."""
        return "NOT (time GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]T[0-9][0-9]:*')"

    def _lock_hours(self, cur: Any) -> None:
        """Make writers of the totals wait until this transaction ends (SQLite: BEGIN IMMEDIATE did)."""

    def _raw_hours(self) -> tuple[str, str]:
        """SQL expressions of (time, instance) as written, for a recount or a backfill."""
        return "time", "instance"

    def _time_text(self, value: Any) -> Any:
        """A stored time as written."""
        return value

    # Reads.
    def totals_pending(self) -> int:
        """How many storage positions ``audit migrate`` still has to count (0: the totals are complete)."""
        row = self._fetch("SELECT upto, done FROM audit_hours_from", [])
        return max(0, int(row[0][0]) - int(row[0][1])) if row else 0

    def stats_from_totals(self, by: str, q: Any) -> list[tuple[Any, int]]:
        """``stats``: whole hours of the window from the totals, the partial hours at its edges (and
        any window, filter or store the totals cannot answer) by an indexed scan."""
        from dataclasses import replace

        windowed = q.since is not None or q.until is not None
        parts = split(q.since, q.until)
        if (
            parts is None
            or q.after_position
            or set(q.filters()) - {"op", "outcome"}
            or self.totals_pending()
            or (windowed and self._fetch(f"SELECT 1 FROM audit_hours WHERE hour = {self.PARAM} LIMIT 1", [ODD]))  # noqa: S608
        ):
            return self._scan_stats(by, q)
        edges, whole = parts
        counts: Counter[Any] = Counter()
        for since, until in edges:
            for key, n in self._scan_stats(by, replace(q, since=since, until=until)):
                counts[key] += n
        if whole is not None:
            p = self.PARAM
            clauses: list[str] = []
            args: list[Any] = []
            for sql, value in (
                (f"hour >= {p}", whole[0]),
                (f"hour < {p}", whole[1]),
                (f"op = {p}", q.op),
                (f"outcome = {p}", q.outcome),
            ):
                if value is not None:
                    clauses.append(sql)
                    args.append(value)
            if windowed:
                clauses.append(f"hour <> {p}")
                args.append(ODD)
            where = " WHERE " + " AND ".join(clauses) if clauses else ""
            for key, n in self._fetch(f"SELECT {by}, SUM(n) FROM audit_hours{where} GROUP BY {by}", args):  # noqa: S608 - `by` checked
                counts[key] += int(n)
        return sorted(((k, n) for k, n in counts.items() if n), key=lambda kv: (-kv[1], kv[0] or ""))

    # Writes.
    def _recount(self, cur: Any, hour: str, counted: tuple[int, int]) -> None:
        p = self.PARAM
        _, instance_sql = self._raw_hours()
        window, args = (self._odd_clause(), []) if hour == ODD else self._hour_window(hour)
        fields = [instance_sql if k == "instance" else k for k in STATS_KEYS]
        cur.execute(f"DELETE FROM audit_hours WHERE hour = {p}", (hour,))  # noqa: S608
        cur.execute(
            f"SELECT {', '.join(fields)}, COUNT(*) FROM audit_events WHERE ({window}) "  # noqa: S608 - fixed names
            f"AND (id > {p} OR id <= {p}) GROUP BY {', '.join(fields)}",
            (*args, *counted),
        )
        add(cur, p, Counter({(hour, *r[:-1]): int(r[-1]) for r in cur.fetchall()}))

    def recount_after_prune(self, before: str, newest_deleted: str | None, odd_deleted: bool) -> None:
        """After a prune deleted records older than `before` (the newest deleted event time
        `newest_deleted`): drop the hours before the oldest kept event and recount the rest up to
        the cut from the kept rows, in one transaction that writers of the totals wait for.

        Raises:
            AuditError: the store cannot be read or written (the totals stay as they were).
        """
        p = self.PARAM
        with self._transaction(RECOUNT) as cur:
            self._begin(cur)
            self._lock_hours(cur)
            counted = state(cur)
            cur.execute("SELECT MIN(time) FROM audit_events")
            oldest = self._time_text(cur.fetchone()[0])
            low = None if oldest is None else hour_of(oldest)
            if low is None:  # nothing kept
                cur.execute("DELETE FROM audit_hours")
                return
            if low != ODD:
                cur.execute(f"DELETE FROM audit_hours WHERE hour < {p}", (low,))  # noqa: S608
            high = hour_of(max(before, newest_deleted or before))
            cur.execute(
                f"SELECT DISTINCT hour FROM audit_hours WHERE hour <= {p}"  # noqa: S608
                + ("" if low == ODD else f" AND hour >= {p}"),
                (high,) if low == ODD else (high, low),
            )
            todo = [str(h) for (h,) in cur.fetchall()]
            if odd_deleted:
                cur.execute(f"SELECT 1 FROM audit_hours WHERE hour = {p} LIMIT 1", (ODD,))  # noqa: S608
                todo += [ODD] if cur.fetchone() else []
            for hour in todo:
                self._recount(cur, hour, counted)

    def backfill(self, page: int = BACKFILL_PAGE) -> int:
        """Count the events written before the totals existed (``audit migrate``), `page` rows per
        transaction; returns how many were counted. Resumable: an interrupted run goes on from the
        last page that committed.

        Raises:
            AuditError: the store cannot be read or written.
        """
        p = self.PARAM
        time_sql, instance_sql = self._raw_hours()
        fields = [instance_sql if k == "instance" else k for k in STATS_KEYS]
        sql = (
            f"SELECT id, {time_sql}, {', '.join(fields)} FROM audit_events WHERE id > {p} AND id <= {p} "  # noqa: S608
            f"ORDER BY id LIMIT {int(page)}"
        )
        counted = 0
        while True:
            with self._transaction(RECOUNT) as cur:
                self._begin(cur)
                self._lock_hours(cur)
                upto, done = state(cur)
                if done >= upto:
                    return counted
                cur.execute(sql, (done, upto))
                rows = [(r[0], self._time_text(r[1]), *r[2:]) for r in cur.fetchall()]
                add(cur, p, tally(rows, 1, range(2, 2 + len(STATS_KEYS))))
                last = int(rows[-1][0]) if len(rows) == page else upto
                cur.execute(f"UPDATE audit_hours_from SET done = {p}", (last,))  # noqa: S608
                counted += len(rows)
