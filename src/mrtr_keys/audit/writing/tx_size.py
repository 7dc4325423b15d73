"""`TransactionSize`: how many events an audit writer stores in one transaction, now.

A store that answers, but too slowly for a whole transaction (a congested link, a starved server: the
PostgreSQL store cuts a write at `mrtr_keys.audit.writing.stores.postgres.WRITE_DEADLINE`), would fail the
same transaction on every retry and store nothing (issue 22's gray failure). Both writers (the writer
process, `mrtr_keys.audit.writing.writer.child`, and the in-process
`mrtr_keys.audit.writing.direct.DirectWriter`) therefore store a failed transaction again in parts of
`TransactionSize.now` events: halved after each failed write, and after one that took longer than
`SHRINK_SECONDS` (down to `MIN_EVENTS`), doubled after one stored within `GROW_SECONDS` (up to the
writer's largest). So a store that is only slow settles on transactions of about half a second to a
second, which it can take and which the writer process acknowledges more often than the sink's
silent-store limit (`mrtr_keys.audit.capture.sink.SILENT_AFTER`, 1 s), and one that is fast again gets
full ones within a few writes (docs/audit.md, "Deadlines").
"""

from __future__ import annotations

MIN_EVENTS = 50
"""Fewest events a transaction is cut down to while writes keep failing."""
GROW_SECONDS = 0.5
"""A transaction stored within this many seconds lets the next one be twice as large again."""
SHRINK_SECONDS = 1.0
"""A transaction that took longer than this many seconds to store makes the next one half as large."""


class TransactionSize:
    """The most events to store in one transaction now: `most` until a write fails."""

    __slots__ = ("most", "now")

    def __init__(self, most: int) -> None:
        self.most = most
        self.now = most

    def failed(self) -> None:
        """A write failed: the next transaction is half as large (not below `MIN_EVENTS`)."""
        self.now = max(min(MIN_EVENTS, self.most), self.now // 2)

    def stored(self, seconds: float) -> None:
        """A write of a transaction took `seconds`: under `GROW_SECONDS`, the next may be twice as large;
        over `SHRINK_SECONDS`, it is half as large."""
        if seconds < GROW_SECONDS:
            self.now = min(self.most, self.now * 2)
        elif seconds > SHRINK_SECONDS:
            self.failed()
