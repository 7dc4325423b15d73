"""The presence store's ``key_usage`` table on every store kind (`mrtr_keys.audit.writing.stores.key_usage`): whole rows
replaced by their own source, read back per ring, and settled into one row per kid without counting a row twice
when two processes settle at once."""

from __future__ import annotations

import secrets
import threading
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.audit.writing.stores.key_usage import SETTLED, UsageRow, totals
from mrtr_keys.audit.writing.stores.url import open_store

T9, T10, T11 = (f"2026-12-06T{h}:00:00.000000Z" for h in ("09", "10", "11"))


@pytest.fixture(params=["sqlite", "jsonl", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        url = f"sqlite://{tmp_path / 'audit.db'}"
    elif request.param == "jsonl":
        url = f"jsonl://{tmp_path / 'audit.jsonl'}"
    else:
        url = request.getfixturevalue("postgres_url")
    s = open_store(url)
    yield s
    s.close()


@pytest.fixture
def ring() -> str:
    return "r-" + secrets.token_hex(8)  # a PostgreSQL store may hold other tests' rings: this test's own


def _row(ring: str, source: str, seals: int, sealed: int, updated: str = T10) -> UsageRow:
    name = source.partition("#")[0]
    return UsageRow(ring, "aaaaaaaa", source, name, seals, sealed, 3, 1, seals - sealed, updated, "running")


def test_rows_are_replaced_by_their_source_and_summed_per_kid(store: Any, ring: str) -> None:
    store.put_usage([_row(ring, "a#1", 100, 10), _row(ring, "b#2", 50, 50)])
    store.put_usage([_row(ring, "a#1", 200, 150)])  # the same source writes again: replaced, not added
    store.put_usage([_row(ring + "x", "c#3", 7, 7)])  # another ring
    t = totals(store.usage_rows(ring))["aaaaaaaa"]
    assert (t.seals, t.sealed, t.unseals, t.rejections, t.blocks, t.sources) == (250, 200, 6, 2, 50, 2)


def test_settling_folds_sources_once_even_when_two_settle_together(store: Any, ring: str) -> None:
    store.put_usage([_row(ring, f"p#{i}", 10 + i, 10, T9) for i in range(20)])
    store.put_usage([_row(ring, "live#1", 5, 5, T11)])
    before = totals(store.usage_rows(ring))["aaaaaaaa"].seals
    folded: list[int] = []
    other = store if store.url.startswith("jsonl") else open_store(store.url)
    threads = [
        threading.Thread(target=lambda s=s: folded.append(s.settle_usage(ring, before=T10))) for s in (store, other)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    rows = store.usage_rows(ring)
    assert sorted(r.source for r in rows) == sorted([SETTLED, "live#1"]) and sum(folded) == 20
    assert totals(rows)["aaaaaaaa"].seals == before  # folded, never lost nor counted twice
    assert store.settle_usage(ring, source="live#1") == 1
    assert [r.source for r in store.usage_rows(ring)] == [SETTLED]


def test_a_settled_reservation_keeps_its_block(store: Any, ring: str) -> None:
    """A killed process's row (reserved 100, sealed 40) folded into the settled row: seals - blocks is still a
    count that was true, so the fleet total stays at most the blocks above the truth."""
    store.put_usage([_row(ring, "killed#1", 100, 40, T9)])
    store.settle_usage(ring, before=T10)
    t = totals(store.usage_rows(ring))["aaaaaaaa"]
    assert (t.seals, t.sealed, t.blocks) == (100, 40, 60)
