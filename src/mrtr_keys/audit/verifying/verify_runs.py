"""`Walker.feed_runs` (`mrtr_keys.audit.verifying.verify_stream.Walker`): the walk over SQLite schema 4 pages
rendered as `mrtr_keys.audit.writing.stores.narrow.Run` s, with the row walk's findings.

A run's text is appended to its chain's open batch as one piece; a row is decoded (through the
view, ``view.rows(lo, hi)``) only where the walk needs its values: a batch's last record (its link
and time), the record the row walk would report as a broken batch's first (`RunWalk._first`), and
every row of a run that is out of order or of a writer the view does not know, which goes through
the row walk itself (`RunWalk._one`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from mrtr_keys.errors import AuditUnavailable

MAX_PENDING = 8_192
"""Rows of one chain's open batch kept as objects; past this they are fed to an incremental hash."""


class RunWalk:
    """Mixin of `mrtr_keys.audit.verifying.verify_stream.Walker` (which supplies what is declared here)."""

    report: Any
    _chains: dict[str, Any]
    _by_raw: dict[int, Any]
    _view: Any

    def chain(self, writer: str) -> Any:
        raise NotImplementedError

    def feed(self, rows: Sequence[tuple[Any, ...]]) -> None:
        raise NotImplementedError

    def _close(self, c: Any, row: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def _spill(self, c: Any) -> None:
        raise NotImplementedError

    def feed_runs(self, runs: Iterable[tuple[Any, ...]], view: Any) -> None:
        """`feed` for `mrtr_keys.audit.writing.stores.narrow.Run` s (a page of raw rows of SQLite schema 4,
        rendered by `view`, a `narrow.Pieces`): the same walk and findings; a row is decoded
        (``view.rows``) only where the walk needs its values (a batch's first and last record, a
        record out of order or of an unknown writer)."""
        by_raw = self._by_raw
        self._view = view
        for lo, hi, w, s0, s1, n, closes, text in runs:
            self.report.records += n
            c = by_raw.get(w) if w is not None else None
            if c is None and w is not None:
                name = view.name(w)
                if w in view.codec.names:
                    c = by_raw[w] = self.chain(name)
                    if c.began is None:
                        c.began = lo
            if c is not None and c.brk is not None:
                gap = c.gap
                if gap is not None and s0 < gap[1] and s1 > gap[0]:  # one of seqs s0..s1-1 is in the gap
                    c.brk[0], c.brk[4] = "reordered", f"record seq {c.brk[2]} is stored before seq {gap[0]}"
                    c.gap = None
                continue
            if c is None or s0 != c.expected:
                for row in self._rows(lo, hi, n):
                    self._one(row)
                continue
            c.runs.append((lo, hi, s0))
            c.pending.append(text)
            c.pieces += 1
            c.expected = s1
            c.nonlink += n - closes
            if closes:
                self._close(c, self._rows(hi, hi, 1)[0])
            elif c.nonlink >= MAX_PENDING:
                self._spill(c)

    def _first(self, c: Any, n: int) -> Any:
        """The open batch's record the row walk holds as its first (`n` rows so far): its first, or
        after a spill (`MAX_PENDING`) the first after the last spill."""
        if not c.runs or c.runs[0][2] != c.expected - n:  # fed as rows (or both): as it recorded
            return c.first
        want = c.runs[0][2] + MAX_PENDING * ((n - 1) // MAX_PENDING)
        for lo, hi, s0 in reversed(c.runs):
            if s0 <= want:
                found = next((r for r in self._rows(lo, hi, hi - lo + 1, exact=False) if r[13] == want), None)
                if found is None:
                    raise _changed(lo, hi)
                return found
        return c.first

    def _rows(self, lo: int, hi: int, n: int, *, exact: bool = True) -> list[Any]:
        """The decoded rows at positions `lo`..`hi`, read again (`n` of them were rendered, or at
        most `n` if not `exact`: a run's positions need not be consecutive).

        Raises:
            AuditUnavailable: they are no longer all there (removed since they were rendered: the
                rows read for the text and the rows read again are two reads of a live store).
        """
        rows: list[Any] = self._view.rows(lo, hi)
        if (len(rows) != n) if exact else not rows:
            raise _changed(lo, hi)
        return rows

    def _one(self, row: tuple[Any, ...]) -> None:
        """`feed` one decoded row (counted by `feed_runs`), keeping `Any.nonlink`."""
        self.feed((row,))
        self.report.records -= 1
        c = self._chains.get(row[12])
        if c is not None and c.brk is None and c.pending and c.expected == row[13] + 1 and not row[15]:
            c.nonlink += 1


def _changed(lo: int, hi: int) -> AuditUnavailable:
    return AuditUnavailable(
        f"audit verify: the records at storage positions {lo}..{hi} changed while they were read "
        "(removed by a prune running meanwhile?): run verify again"
    )
