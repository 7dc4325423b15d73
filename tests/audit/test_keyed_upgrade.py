"""Upgrading a store written before keyed links (tests/fixtures/audit_v4: written by release 0.2.0's own
writers, three chains and a checkpoint): the first keyed writer records the switch, keyed batches follow,
and ``audit verify`` passes, saying how many records it verified keyed and unkeyed. The old chains may
go on unkeyed (a writer of the old release still running during a rolling upgrade); a chain that begins
after the switch may not, and a rewrite of the keyed part is caught. docs/audit.md, "Keyed links"."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.writing import switch
from mrtr_keys.audit.writing.chain import batch_hash, event_values
from mrtr_keys.audit.writing.fingerprint import Fingerprinter, load_audit_key
from mrtr_keys.audit.writing.stores.url import open_store
from tests.fixtures.audit import cli, known_events, sqlite_exec

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "audit_v4"
OLD_RECORDS = 263
"""Records in the fixture, in three chains (`tests/fixtures/audit_v4/make.py`)."""


@pytest.fixture
def old_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path, Path]:
    """(URL, checkpoint file, state directory) of a copy of the fixture, whose audit key is this host's
    own (``audit.key`` in the state directory, as the fixture's writers had it)."""
    state = tmp_path / "state"
    state.mkdir()
    shutil.copyfile(FIXTURE / "audit.key", state / "audit.key")
    (state / "audit.key").chmod(0o600)
    for name in ("store.db", "checkpoints.jsonl"):
        shutil.copyfile(FIXTURE / name, tmp_path / name)
    monkeypatch.delenv("MRTR_KEYS_AUDIT_KEY_FILE", raising=False)
    monkeypatch.setenv("MRTR_KEYS_STATE_DIR", str(state))
    return f"sqlite://{tmp_path}/store.db", tmp_path / "checkpoints.jsonl", state


def _verify(url: str, cps: Path) -> tuple[int, str, dict[str, object]]:
    res = cli("audit", "verify", "--audit", url, "--checkpoints", str(cps))
    doc = json.loads(cli("audit", "verify", "--audit", url, "--checkpoints", str(cps), "--json").out)
    return res.code, (res.out + res.err).strip(), doc


def _unkeyed_batch(url: str, writer: str, after: int, head: str, n: int = 2) -> None:
    """Append `n` events to chain `writer` after its seq `after` (link `head`) with an unkeyed link, as the
    old release's writer does."""
    rows = [(*event_values(e), writer, after + i, "", "") for i, e in enumerate(known_events(n), 1)]
    rows[-1] = (*rows[-1][:-2], head, batch_hash(head, rows))
    store = open_store(url)
    store.append_rows(rows)
    store.close()


def test_an_old_store_takes_keyed_batches_from_a_recorded_switch_and_verifies_both(
    old_store: tuple[str, Path, Path],
) -> None:
    url, cps, state = old_store
    code, out, doc = _verify(url, cps)
    assert code == 0 and f"ok: {OLD_RECORDS} records in 3 chains verified (0 keyed, {OLD_RECORDS} unkeyed" in out, out
    assert "3 checkpointed heads present" in out
    sink = AuditSink(open_store(url), Fingerprinter(load_audit_key(state)), mode="process")  # the new release
    sink.ring_loaded("billing", 3, "cccccccc")
    for i in range(50):
        sink.record("seal", kid="cccccccc", audience="billing", token=f"mk1.{'C' * 40}{i:04d}", generation=3)
    assert sink.flush(30)
    sink.close()
    store = open_store(url)
    recorded = json.loads(store.meta(switch.NAME))
    store.close()
    assert recorded["position"] == OLD_RECORDS and recorded["mac"].startswith("v2:")
    # a writer of the old release, running through the upgrade, goes on with its chain: allowed
    old_head = json.loads(cps.read_text().splitlines()[-1])["heads"][0]
    _unkeyed_batch(url, old_head["writer"], old_head["seq"], old_head["hash"])
    code, out, doc = _verify(url, cps)
    assert code == 0, out
    assert doc["keyed"] == 51 and doc["unkeyed"] == OLD_RECORDS + 2 and doc["records"] == OLD_RECORDS + 53
    assert doc["chain_switch"] == {"position": OLD_RECORDS, "key_id": recorded["key_id"], "time": recorded["time"]}
    assert f"(51 keyed, {OLD_RECORDS + 2} unkeyed: written before the switch to keyed links at position" in out, out
    assert "3 checkpointed heads present" in out


def test_after_the_switch_a_new_unkeyed_chain_and_a_rewrite_of_the_keyed_part_are_caught(
    old_store: tuple[str, Path, Path],
) -> None:
    url, cps, state = old_store
    sink = AuditSink(open_store(url), Fingerprinter(load_audit_key(state)), mode="thread")
    sink.write_now(known_events(4))
    sink.close()
    _unkeyed_batch(url, "old-release:1:20261206T000000.000000Z#1", 0, "0" * 64)  # begins after the switch
    code, out, _ = _verify(url, cps)
    assert code == 1 and out.startswith(f"BROKEN: altered record at position {OLD_RECORDS + 5} "), out
    assert "an unkeyed link in a chain that began after the store's switch to keyed links" in out
    sqlite_exec(url, f"DELETE FROM audit_events WHERE id > {OLD_RECORDS + 4}")
    assert _verify(url, cps)[0] == 0
    sqlite_exec(url, f"UPDATE audit_events SET outcome = 'ok', reason = NULL WHERE id = {OLD_RECORDS + 3}")
    code, out, _ = _verify(url, cps)
    assert code == 1 and out.startswith(f"BROKEN: altered record at position {OLD_RECORDS + 1} "), out
    assert "records seq 1..4: their fields do not match their batch's hash" in out
