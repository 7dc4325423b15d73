"""How many events an audit writer puts in one transaction while the store is slow (docs/audit.md, "Deadlines")."""

from __future__ import annotations

from mrtr_keys.audit.capture.sink import SILENT_AFTER
from mrtr_keys.audit.writing.tx_size import GROW_SECONDS, MIN_EVENTS, SHRINK_SECONDS, TransactionSize


def test_failed_and_slow_writes_halve_the_next_transaction_and_quick_ones_double_it() -> None:
    size = TransactionSize(2_000)
    assert size.now == 2_000
    size.failed()
    assert size.now == 1_000
    size.stored(1.3)  # stored, but slower than the writer can acknowledge within the silent-store limit
    assert size.now == 500
    size.stored(0.8)  # half a second to a second: kept
    assert size.now == 500
    for _ in range(10):
        size.failed()
    assert size.now == MIN_EVENTS
    for _ in range(10):
        size.stored(0.01)
    assert size.now == 2_000  # never past the writer's largest


def test_a_writer_smaller_than_the_floor_keeps_its_own_size() -> None:
    size = TransactionSize(10)
    size.failed()
    assert size.now == 10


def test_a_settled_transaction_is_acknowledged_within_the_silent_store_limit() -> None:
    """The rule's window sits under the sink's limit: a transaction that is kept took at most `SHRINK_SECONDS`."""
    assert GROW_SECONDS < SHRINK_SECONDS <= SILENT_AFTER
