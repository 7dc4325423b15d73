"""`audit stats` answers from hourly totals (issue 26, deliver 5) and still equals a plain count of
the events: after writes, after a prune, after an archive, on SQLite and PostgreSQL, with and without
``--since``/``--until``/``--op``/``--outcome``; an existing store gets its totals from ``audit
migrate``. (After a resend: tests/audit/test_resend.py.)

Logs are genuine (`bench.audit_log.fill`): 2 000 events over 4 days on three chains (not 40: a
PostgreSQL store makes a table a day, and forty of them were most of these tests' time).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from bench.audit_log import DAY, fill

from mrtr_keys.audit.events import parse_when
from mrtr_keys.audit.writing.stores.base import Query
from mrtr_keys.audit.writing.stores.url import open_store
from tests.fixtures.audit import cli, pg_exec, sqlite_exec

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key

EVENTS = 2_000
SPAN = 4 * DAY
CASES = (
    ("instance", ()),
    ("op", ("--outcome", "rejected")),
    ("reason", ("--since", "84h")),  # a partial hour at the start, whole hours to now
    ("outcome", ("--until", "29h", "--op", "seal")),
    ("instance", ("--since", "79h", "--until", "74h", "--op", "unseal", "--outcome", "ok")),
    ("op", ("--since", "48h", "--until", "48h")),  # empty
)


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Callable[..., None]]:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/audit.db", sqlite_exec
    return request.getfixturevalue("postgres_url"), pg_exec


def _stats(url: str, by: str, *args: str) -> dict[str | None, int]:
    res = cli("audit", "stats", "--by", by, "--audit", url, "--json", *args)
    assert res.code == 0, res.err
    return {row["key"]: row["count"] for row in json.loads(res.out)}


def _counted(url: str, by: str, *args: str) -> dict[str | None, int]:
    """The same question answered by reading every matching event."""
    opts = dict(zip(args[::2], args[1::2], strict=True))
    q = Query(
        since=parse_when(opts["--since"]) if "--since" in opts else None,
        until=parse_when(opts["--until"]) if "--until" in opts else None,
        op=opts.get("--op"),
        outcome=opts.get("--outcome"),
    )
    s = open_store(url)
    try:
        return dict(Counter(getattr(r.event, by) for r in s.iter_query(q)))
    finally:
        s.close()


def _check(url: str) -> None:
    for by, args in CASES:
        assert _stats(url, by, *args) == _counted(url, by, *args), (by, args)


def test_stats_equals_a_plain_count_after_writes_prune_and_archive(
    store: tuple[str, Callable[..., None]], tmp_path: Path
) -> None:
    url, _ = store
    fill(url, EVENTS, tx=EVENTS // 24, span=SPAN)
    _check(url)
    assert sum(_stats(url, "op").values()) == EVENTS
    cps = tmp_path / "checkpoints.jsonl"
    res = cli("audit", "prune", "--before", "72h", "--audit", url, "--checkpoints", str(cps), "--json")
    assert res.code == 0 and json.loads(res.out)["deleted"] > 0, res.err
    _check(url)
    fill(url, 300, tx=50, host="later-host", span=SPAN)  # writes after the prune, then an archive cuts again
    res = cli(
        "audit", "archive", "--before", "60h", "--audit", url, "--to", str(tmp_path / "arch"),
        "--checkpoints", str(cps), "--json",
    )  # fmt: skip
    assert res.code == 0 and json.loads(res.out)["deleted"] > 0, res.err
    _check(url)
    total = sum(_stats(url, "op").values())
    assert total == open_store(url).count()


def test_an_existing_store_is_counted_by_scanning_until_migrate_builds_its_totals(
    store: tuple[str, Callable[..., None]],
) -> None:
    url, execute = store
    fill(url, EVENTS, tx=EVENTS // 24, span=SPAN)
    execute(url, "DROP TABLE audit_hours", "DROP TABLE audit_hours_from")  # a store from before the totals
    fill(url, 200, tx=50, host="later-host", span=SPAN)  # reopened: totals from here on
    _check(url)
    res = cli("audit", "migrate", "--audit", url, "--json")
    assert res.code == 0 and json.loads(res.out)["counted"] == EVENTS, res.err
    _check(url)
    res = cli("audit", "migrate", "--audit", url)
    assert res.code == 2 and "nothing to migrate" in res.err, res.err


def test_an_edit_of_the_totals_is_not_seen_by_verify_and_the_documented_rebuild_repairs_them(tmp_path: Path) -> None:
    """docs/audit.md: the totals are outside the hash chains (``verify`` passes over an edit of
    them); dropping both tables and running ``audit migrate`` counts every event again."""
    url = f"sqlite://{tmp_path}/audit.db"
    fill(url, 600, tx=100)
    true = _counted(url, "op")
    sqlite_exec(url, "UPDATE audit_hours SET n = n + 1000 WHERE rowid = (SELECT MIN(rowid) FROM audit_hours)")
    assert sum(_stats(url, "op").values()) == sum(true.values()) + 1_000
    res = cli("audit", "verify", "--audit", url, "--checkpoints", str(tmp_path / "cp.jsonl"))
    assert res.code == 0 and res.out.startswith("ok: 600 records"), res.out + res.err
    sqlite_exec(url, "DROP TABLE audit_hours", "DROP TABLE audit_hours_from")
    res = cli("audit", "migrate", "--audit", url, "--json")
    assert res.code == 0 and json.loads(res.out)["counted"] == 600, res.err
    assert _stats(url, "op") == true
