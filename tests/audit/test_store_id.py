"""Checkpoints follow the store, not the spelling of its URL: every SQL store carries a random store
id (made with the store, kept in it), checkpoint records carry it, and `audit verify` / `prune` match
them by it (`mrtr_keys.audit.verifying.store_match`). Records written before store ids still match by URL.

Logs are genuine (`bench.audit_log.fill`), small: 1 200 events over 40 days in batches of 50, so a
30-day prune cuts every chain.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from bench.audit_log import DAY, fill

from tests.fixtures.audit import cli, sqlite_exec

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key

EVENTS = 1_200
TX = 50


def _prune(url: str, cps: Path, before: str = "30d") -> dict[str, object]:
    res = cli("audit", "prune", "--before", before, "--audit", url, "--checkpoints", str(cps), "--json")
    assert res.code == 0, res.err
    out = json.loads(res.out)
    assert len(out["cuts"]) == 3 and out["deleted"] > 0
    return out  # type: ignore[no-any-return]


def _verify(url: str, cps: Path) -> tuple[dict[str, object], str]:
    res = cli("audit", "verify", "--audit", url, "--checkpoints", str(cps), "--json")
    doc = json.loads(res.out)
    assert res.code == (0 if doc["ok"] else 1), res.err
    return doc, res.err


def _records(cps: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in cps.read_text().splitlines()]


def test_a_sqlite_store_named_by_a_relative_path_or_copied_verifies_after_a_prune(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    absolute = f"sqlite://{tmp_path}/a/audit.db"
    cps = tmp_path / "cp.jsonl"
    fill(absolute, EVENTS, tx=TX)
    monkeypatch.chdir(tmp_path / "b")
    _prune("sqlite:../a/audit.db", cps)  # recorded as sqlite:///.../b/../a/audit.db
    (cut,) = _records(cps)
    assert "/b/../a/audit.db" in str(cut["store"]) and len(str(cut["store_id"])) == 32
    doc, err = _verify(absolute, cps)
    assert doc["ok"] and doc["pruned_before"] and doc["checkpoints_by_id"] == 1, (doc, err)
    assert doc["store_id"] == cut["store_id"] and "note" not in err
    # a copy byte for byte is the same store: its cut still applies (without it: "records 1..N are missing")
    (tmp_path / "c").mkdir()
    shutil.copy(tmp_path / "a" / "audit.db", tmp_path / "c" / "audit.db")
    doc, _ = _verify(f"sqlite://{tmp_path}/c/audit.db", cps)
    assert doc["ok"] and doc["pruned_before"] and doc["store_id"] == cut["store_id"]


def test_a_postgres_store_named_with_a_password_and_by_localhost_verifies_after_a_prune(
    postgres_url: str, tmp_path: Path
) -> None:
    assert "@127.0.0.1:" in postgres_url and ":" not in postgres_url.split("://")[1].split("@")[0]
    with_password = postgres_url.replace("@127.0.0.1:", "@localhost:").replace("://postgres@", "://postgres:s3cret-pw@")
    other = postgres_url + "?application_name=mrtr&password=qu3ry-pw"
    cps = tmp_path / "cp.jsonl"
    fill(postgres_url, EVENTS, tx=TX, span=4 * DAY)  # 4 days, not 40: PostgreSQL makes a table a day
    _prune(with_password, cps, "3d")  # trust auth: the password is not checked, but it is in the URL
    text = cps.read_text()
    assert "s3cret-pw" not in text and _records(cps)[0]["store"] == with_password.replace("s3cret-pw", "***")
    for url in (postgres_url, other):
        doc, err = _verify(url, cps)
        assert doc["ok"] and doc["pruned_before"] and doc["checkpoints_by_id"] == 1, (url, doc, err)
    res = cli("audit", "checkpoint", "--audit", other, "--checkpoints", str(cps))
    assert res.code == 0, res.err
    assert "qu3ry-pw" not in cps.read_text() and "password=***" in cps.read_text()
    doc, _ = _verify(with_password, cps)
    assert doc["ok"] and doc["checkpoints_by_id"] == 2 and doc["checkpoints_checked"] == 3


def test_a_checkpoint_file_shared_by_two_stores_applies_each_stores_records_to_it_only(tmp_path: Path) -> None:
    first, second = f"sqlite://{tmp_path}/one/audit.db", f"sqlite://{tmp_path}/two/audit.db"
    cps = tmp_path / "shared.jsonl"
    for url, host in ((first, "one-host"), (second, "two-host")):  # a writer's name is its process's
        fill(url, EVENTS, tx=TX, host=host)
        _prune(url, cps)
    ids = [r["store_id"] for r in _records(cps)]
    assert len(set(ids)) == 2
    for url, sid in ((first, ids[0]), (second, ids[1])):
        doc, _ = _verify(url, cps)
        assert doc["ok"] and doc["store_id"] == sid and doc["checkpoints_by_id"] == 1
    # a new store where the first one was: the first store's cut is never applied to it, and verify
    # says so (a writer rewriting the store's id must not silently drop the anchors)
    (tmp_path / "one" / "audit.db").rename(tmp_path / "first-moved.db")
    fill(first, EVENTS, tx=TX, host="new-host")
    res = cli("audit", "verify", "--audit", first, "--checkpoints", str(cps))
    assert res.code == 1 and res.out.startswith("BROKEN: store id:") and str(ids[0]) in res.out, res.out
    # the moved store keeps its cut; the new one, once checkpointed under its own id, verifies
    doc, _ = _verify(f"sqlite://{tmp_path}/first-moved.db", cps)
    assert doc["ok"] and doc["pruned_before"] and doc["store_id"] == ids[0]
    res = cli("audit", "checkpoint", "--audit", first, "--checkpoints", str(cps))
    assert res.code == 0 and "only under 1 other store id" in res.err, res.err
    doc, _ = _verify(first, cps)
    assert doc["ok"] and not doc["pruned_before"] and doc["other_store_ids"] == [ids[0]]


def test_an_old_checkpoint_record_without_a_store_id_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    cps = tmp_path / "cp.jsonl"
    fill(url, EVENTS, tx=TX, keyed=False)
    _prune(url, cps)
    # as an earlier mrtr-keys left them: no store id in the store nor in its checkpoint records (nor a MAC)
    old = [{k: v for k, v in r.items() if k not in ("store_id", "mac")} for r in _records(cps)]
    cps.write_text("".join(json.dumps(r) + "\n" for r in old))
    sqlite_exec(url, "DROP TABLE store_meta")
    doc, err = _verify(url, cps)
    assert doc["ok"] and doc["pruned_before"] and doc["checkpoints_by_url"] == 1 and doc["store_id"]
    assert err.strip().splitlines() == [
        "mrtr-keys: note: 1 checkpoint record without a store id (written before store ids) matched by the store URL"
    ]
    # the id made on that first open stays; new records carry it and match by it
    assert cli("audit", "checkpoint", "--audit", url, "--checkpoints", str(cps)).code == 0
    assert _records(cps)[-1]["store_id"] == doc["store_id"]
    again, _ = _verify(url, cps)
    assert again["ok"] and again["store_id"] == doc["store_id"]
    assert again["checkpoints_by_id"] == 1 and again["checkpoints_by_url"] == 1
    # the next prune that cuts records again, under the id, the old cuts of the chains it does not cut
    # (batch ends are 1.7 days apart across the chains, 5 days within one: a 2-day step cuts 1 or 2 of 3)
    res = cli("audit", "prune", "--before", "28d", "--audit", url, "--checkpoints", str(cps), "--json")
    assert res.code == 0 and 1 <= len(json.loads(res.out)["cuts"]) <= 2, res.out
    assert len(_records(cps)[-1]["carried"]) == 3 - len(json.loads(res.out)["cuts"])  # type: ignore[arg-type]
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    doc, err = _verify("sqlite:../audit.db", cps)  # another spelling: the id-less records do not match it
    assert doc["ok"] and doc["checkpoints_by_url"] == 0 and doc["checkpoints_by_id"] == 2, (doc, err)


def test_a_rewritten_store_id_and_a_cut_tail_are_caught_however_the_store_is_named(tmp_path: Path) -> None:
    """The attack the store id must not open: rewrite the id so that no checkpoint applies, cut the
    newest records. Caught by the chains the old records name (a writer's name is unique to its
    process and store), not only when the URL is spelled as in the file, and the runbook's next
    ``audit checkpoint`` refuses to record the cut heads under the new id."""
    (tmp_path / "data").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    url, other = f"sqlite://{tmp_path}/data/audit.db", f"sqlite://{tmp_path}/link/audit.db"
    cps = tmp_path / "cp.jsonl"
    fill(url, 600, tx=100)
    assert cli("audit", "checkpoint", "--audit", url, "--checkpoints", str(cps)).code == 0
    sqlite_exec(
        url,
        "UPDATE store_meta SET value = '0123456789abcdef0123456789abcdef' WHERE name = 'store_id'",
        "DELETE FROM audit_events WHERE id > (SELECT MAX(id) - 100 FROM audit_events)",
    )
    for name in (url, other):
        res = cli("audit", "verify", "--audit", name, "--checkpoints", str(cps))
        assert res.code == 1 and res.out.startswith("BROKEN: store id: the checkpoint file records "), res.out
        assert "this store's id is 0123456789abcdef0123456789abcdef: " in res.out and "rewritten" in res.out
        res = cli("audit", "checkpoint", "--audit", name, "--checkpoints", str(cps))
        assert res.code == 1 and res.err.startswith("mrtr-keys: checkpoint not recorded: the checkpoint file"), res.err
        assert len(res.err.strip().splitlines()) == 1
    assert len(_records(cps)) == 1
    doc, _ = _verify(other, cps)
    assert not doc["ok"] and "its id was rewritten" in str(doc["store_replaced"])


def test_verify_with_another_checkpoint_file_than_the_prunes_says_where_to_look(tmp_path: Path) -> None:
    """A new user's first slip: prune with --checkpoints FILE, verify without it. The chains then
    start past seq 1 with nothing to say why; the break says which option is missing."""
    url = f"sqlite://{tmp_path}/audit.db"
    fill(url, EVENTS, tx=TX)
    _prune(url, tmp_path / "cp.jsonl")
    res = cli("audit", "verify", "--audit", url, "--checkpoints", str(tmp_path / "other.jsonl"))
    assert res.code == 1 and res.out.startswith("BROKEN: deleted record"), res.out
    assert res.out.splitlines()[0].endswith(
        "; if a prune cut them, it recorded that in another checkpoint file: --checkpoints)"
    ), res.out


def test_a_hand_edited_checkpoint_record_is_a_one_line_usage_error_not_an_internal_error(tmp_path: Path) -> None:
    url, cps = f"sqlite://{tmp_path}/audit.db", tmp_path / "cp.jsonl"
    fill(url, 300, tx=100)
    assert cli("audit", "checkpoint", "--audit", url, "--checkpoints", str(cps)).code == 0
    good = cps.read_text()
    head = _records(cps)[0]["heads"][0]  # type: ignore[index]
    for bad in (
        {"heads": [{"writer": head["writer"]}]},  # no seq (was KeyError)
        {"heads": [{**head, "seq": 1e999}]},  # (was OverflowError)
        {"heads": [{**head, "seq": "12"}]},
        {"heads": [], "kind": "prune", "cuts": [{**head, "hash": None}]},
        {"heads": [], "store_id": 123},
    ):
        cps.write_text(good + json.dumps({"time": "2026-01-01T00:00:00.000000Z", **bad}) + "\n")
        res = cli("audit", "verify", "--audit", url, "--checkpoints", str(cps))
        assert res.code == 2 and res.out == "", (bad, res.code, res.out, res.err)
        why = "a head or cut without a writer, seq and hash, or a store_id not text"
        assert res.err.strip().splitlines() == [f"mrtr-keys: {cps}:2: not a checkpoint ({why})"]


def test_an_export_of_the_store_verifies_beside_its_checkpoint_file(tmp_path: Path) -> None:
    """An export (a JSON-lines log, which has no store id) holds the store's chains: the records of
    the store's id name them, and that is no sign of a rewritten id."""
    url, cps = f"sqlite://{tmp_path}/audit.db", tmp_path / "cp.jsonl"
    fill(url, 300, tx=100)
    assert cli("audit", "checkpoint", "--audit", url, "--checkpoints", str(cps)).code == 0
    res = cli("audit", "export", "--audit", url)
    assert res.code == 0, res.err
    (tmp_path / "export.jsonl").write_text(res.out)
    res = cli("audit", "verify", "--audit", f"jsonl://{tmp_path}/export.jsonl", "--checkpoints", str(cps))
    assert res.code == 0 and res.out.startswith("ok: 300 records in 3 chains verified"), res.out + res.err
