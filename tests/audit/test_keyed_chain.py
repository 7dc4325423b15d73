"""Keyed chain links (docs/audit.md, "Keyed links"): someone with full write access to the store but not
the chain key cannot rewrite it quietly, on SQLite and PostgreSQL.

* The rewrite docs/audit.md describes for the unkeyed chain: one event's outcome changed (a refusal turned
  into a success) and every later link of its chain recomputed as SHA-256, with the store's own SQL:
  ``audit verify`` exits 1 naming the edited batch. The same with the switch record deleted too.
* The whole store replaced by one the product itself wrote under another audit key: exit 1 at the first
  batch (its key id is not the fleet's).
* The keyed link is what makes the difference: the same rewrite of a store written before keyed links
  passes (the documented limit, still caught by checkpoints).
* No key: ``verify``, ``prune``, ``archive`` and ``checkpoint`` say so in one line and exit 2.
* A host's own key does not join a store chained under another host's key; the fleet's key file may (a rotation).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.writing import switch
from mrtr_keys.audit.writing.chain import GENESIS, batch_hash, event_values
from mrtr_keys.audit.writing.fingerprint import Fingerprinter
from mrtr_keys.audit.writing.stores.url import open_store
from mrtr_keys.errors import ConfigError
from tests.fixtures.audit import cli, known_events, pg_exec, sqlite_exec

ALL_TABLES = "audit_events, schema_version, instances, audit_hours, audit_hours_from, store_meta, audit_names"


def _write(url: str, key: bytes, *, fleet: bool = True) -> None:
    """Three batches of two `known_events` (seq 1-2, 3-4, 5-6; seq 3 and 6 rejected), by
    the product's writer under audit key `key`."""
    from mrtr_keys.audit.writing.chain_key import ChainKey

    sink = AuditSink(open_store(url), Fingerprinter(key), mode="thread", chain_key=ChainKey(key, fleet=fleet))
    events = known_events(6)
    for i in range(0, 6, 2):
        sink.write_now(events[i : i + 2])
    sink.close()


def _key_file(tmp_path: Path, key: bytes, name: str = "fleet.key") -> Path:
    path = tmp_path / name
    path.write_bytes(key)
    path.chmod(0o600)
    return path


def _verify(url: str, tmp_path: Path, *extra: str) -> tuple[int, str]:
    res = cli("audit", "verify", "--audit", url, "--checkpoints", str(tmp_path / "none.jsonl"), *extra)
    return res.code, (res.out + res.err).strip()


def _rewrite_without_key(url: str, execute: Callable[..., None], edit_seq: int, *, drop_switch: bool = False) -> None:
    """Turn record `edit_seq`'s ``rejected`` into ``ok`` and recompute its batch's link and every later one
    as SHA-256 over the previous link and ``repr`` of the rows (docs/audit.md's unkeyed chain), with SQL."""
    store = open_store(url)
    records = [r for r in store.records() if r.event.op != "ring-loaded"]
    store.close()
    batches: list[list[object]] = [[]]
    for r in records:
        batches[-1].append(r)
        if r.hash:
            batches.append([])
    prev, sql = GENESIS, []
    for batch in batches[:-1]:
        last = batch[-1]
        if last.seq < edit_seq:  # type: ignore[attr-defined]
            prev = last.hash  # type: ignore[attr-defined]
            continue
        rows = []
        for r in batch:
            values = list(event_values(r.event))  # type: ignore[attr-defined]
            if r.seq == edit_seq:  # type: ignore[attr-defined]
                values[6], values[7] = "ok", None  # outcome, reason
                sql.append(f"UPDATE audit_events SET outcome = 'ok', reason = NULL WHERE id = {r.position}")  # type: ignore[attr-defined]
            rows.append((*values, r.writer, r.seq, "", ""))  # type: ignore[attr-defined]
        link = batch_hash(prev, rows)
        sql.append(f"UPDATE audit_events SET prev_hash = '{prev}', hash = '{link}' WHERE id = {last.position}")  # type: ignore[attr-defined]
        prev = link
    if drop_switch:
        sql.append(f"DELETE FROM store_meta WHERE name = '{switch.NAME}'")
    execute(url, *sql)


@pytest.fixture(params=["sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Callable[..., None]]:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/audit.db", sqlite_exec
    return request.getfixturevalue("postgres_url"), pg_exec


@pytest.mark.parametrize("drop_switch", [False, True], ids=["links", "links and switch record"])
def test_a_rewrite_with_recomputed_unkeyed_links_is_caught(
    store: tuple[str, Callable[..., None]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, drop_switch: bool
) -> None:
    url, execute = store
    key = os.urandom(32)
    monkeypatch.setenv("MRTR_KEYS_AUDIT_KEY_FILE", str(_key_file(tmp_path, key)))
    _write(url, key)
    code, out = _verify(url, tmp_path)
    assert code == 0 and "ok: 6 records in 1 chain verified (6 keyed, 0 unkeyed)" in out, out
    _rewrite_without_key(url, execute, edit_seq=3, drop_switch=drop_switch)
    code, out = _verify(url, tmp_path)
    assert code == 1, out
    first = out.splitlines()[0]
    assert first.startswith("BROKEN: altered record at position 3 ") and "seq 3," in first, out
    assert "records seq 3..4: an unkeyed link after this chain's keyed ones" in first, out


def test_the_same_rewrite_of_an_unkeyed_store_passes_the_chain_and_only_a_checkpoint_catches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why the key: the attack above on a store written before keyed links (docs/audit.md's old limit)."""
    from bench.audit_log import fill

    url, key = f"sqlite://{tmp_path}/audit.db", os.urandom(32)
    monkeypatch.setenv("MRTR_KEYS_AUDIT_KEY_FILE", str(_key_file(tmp_path, key)))
    fill(url, 6, tx=2, chains=1, keyed=False, audit_key=key)
    sqlite_exec(url, "UPDATE audit_events SET outcome = 'rejected', reason = 'expired' WHERE seq = 3")
    sqlite_exec(url, "UPDATE audit_events SET prev_hash = '', hash = '' WHERE seq >= 3")  # unlinked, to relink
    store_ = open_store(url)
    rows = [r for r in store_.records()]
    store_.close()
    prev = next(r.hash for r in rows if r.seq == 2)
    for lo in (3, 5):
        batch = [(*event_values(r.event), r.writer, r.seq, "", "") for r in rows if lo <= r.seq <= lo + 1]
        link = batch_hash(prev, batch)
        sqlite_exec(url, f"UPDATE audit_events SET prev_hash = '{prev}', hash = '{link}' WHERE seq = {lo + 1}")
        prev = link
    _rewrite_without_key(url, sqlite_exec, edit_seq=3)
    code, out = _verify(url, tmp_path)
    assert code == 0 and "(0 keyed, 6 unkeyed" in out, out


def test_a_store_replaced_by_one_written_under_another_key_is_caught(
    store: tuple[str, Callable[..., None]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, execute = store
    ours, theirs = os.urandom(32), os.urandom(32)
    monkeypatch.setenv("MRTR_KEYS_AUDIT_KEY_FILE", str(_key_file(tmp_path, ours)))
    _write(url, ours)
    if url.startswith("sqlite"):
        other = tmp_path / "other.db"
        _write(f"sqlite://{other}", theirs)
        shutil.copyfile(other, tmp_path / "audit.db")  # the store file replaced whole
    else:
        execute(url, f"DROP TABLE IF EXISTS {ALL_TABLES}")
        _write(url, theirs)  # the product's own writer, under the other key, into the emptied database
    code, out = _verify(url, tmp_path)
    assert code == 1, out
    first = out.splitlines()[0]
    assert first.startswith("BROKEN: altered record at position 1 ") and "records seq 1..2" in first, out
    assert "linked under chain key id" in first and "which this verifier does not hold" in first, out


@pytest.mark.parametrize(
    "command",
    [
        ("audit", "verify"),
        ("audit", "checkpoint"),
        ("audit", "prune", "--before", "30d"),
        ("audit", "archive", "--before", "30d", "--to", "ARCHIVE"),
    ],
    ids=["verify", "checkpoint", "prune", "archive"],
)
def test_without_the_key_a_verifying_command_says_so_in_one_line_and_exits_2(
    command: tuple[str, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    _write(url, os.urandom(32))
    monkeypatch.delenv("MRTR_KEYS_AUDIT_KEY_FILE", raising=False)
    monkeypatch.setenv("MRTR_KEYS_STATE_DIR", str(tmp_path / "state"))  # a state directory without audit.key
    args = [a.replace("ARCHIVE", str(tmp_path / "archive")) for a in command]
    res = cli(*args, "--audit", url, "--checkpoints", str(tmp_path / "cps.jsonl"))
    assert res.code == 2 and res.out == "", res.out
    assert len(res.err.strip().splitlines()) == 1 and "needs the audit chain key" in res.err, res.err
    assert "audit.key" in res.err and "MRTR_KEYS_AUDIT_KEY_FILE" in res.err
    assert not (tmp_path / "state" / "audit.key").exists()  # never created by a verifier


def test_a_hosts_own_key_does_not_join_a_store_chained_under_another_hosts(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    _write(url, os.urandom(32), fleet=False)  # host A, its own audit.key
    with pytest.raises(ConfigError, match="every writer of one store needs the fleet's audit key"):
        _write(url, os.urandom(32), fleet=False)  # host B, its own: refused before it links anything
    _write(url, os.urandom(32), fleet=True)  # the fleet's key file (a rotation): accepted
    store_ = open_store(url)
    assert json.loads(store_.meta(switch.NAME))["position"] == 0  # the switch stays where it was recorded
    assert store_.count() == 12
    store_.close()
