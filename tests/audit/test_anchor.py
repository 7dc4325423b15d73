"""Anchors (`mrtr_keys.audit.verifying.anchor`, docs/audit.md "Anchors"): the heads of a process's chains, MACed with
the chain key and written where the store's writers cannot reach, catch what a chain alone cannot show.

* whole batches cut off the newest end of a chain: the chain verifies, the anchor does not;
* an anchor record forged or edited without the key is not trusted (a break, its heads unused);
* a store cut back to before its switch to keyed links, switch record and all: the anchor noted the switch;
* a destination that cannot be written: each run fails with one WARNING per distinct error and a count,
  nothing raised into the caller, and the next run after it is back succeeds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.verifying.anchor import Anchorer
from mrtr_keys.audit.writing.fingerprint import Fingerprinter
from mrtr_keys.audit.writing.stores.url import open_store
from tests.fixtures.audit import cli, known_events, sqlite_exec

pytestmark = pytest.mark.usefixtures("audit_key")  # writers and the CLI share the fleet's key


def _sink(url: str, key: bytes) -> AuditSink:
    return AuditSink(open_store(url), Fingerprinter(key), mode="thread")


def _verify(url: str, *sources: str) -> tuple[int, str]:
    args = [a for s in sources for a in ("--checkpoints", s)] or ["--checkpoints", "/nonexistent/cps.jsonl"]
    res = cli("audit", "verify", "--audit", url, *args)
    return res.code, (res.out + res.err).strip()


def test_an_anchor_catches_whole_batches_cut_off_the_end_that_the_chain_alone_cannot_show(
    tmp_path: Path, audit_key: bytes
) -> None:
    url, anchors = f"sqlite://{tmp_path}/audit.db", f"{tmp_path}/anchors/"
    sink = _sink(url, audit_key)
    for i in range(3):
        sink.write_now(known_events(6)[2 * i : 2 * i + 2])  # three batches: seq 1-2, 3-4, 5-6
    anchor = Anchorer(sink, anchors, every=60)
    assert anchor.run_once() and anchor.status()["anchors"] == 1 and anchor.status()["error"] is None
    (record,) = [json.loads(line) for f in (tmp_path / "anchors").iterdir() for line in f.read_text().splitlines()]
    assert record["kind"] == "anchor" and record["instance"] == sink.writer and record["mac"].startswith("v2:")
    assert record["heads"] == [
        {"writer": sink.writer, "seq": 6, "hash": record["heads"][0]["hash"], "time": known_events(6)[5].time}
    ]
    assert record["chain_switch"]["position"] == 0
    code, out = _verify(url, anchors)
    assert code == 0 and "1 checkpointed head present" in out, out
    sink.close()
    sqlite_exec(url, "DELETE FROM audit_events WHERE seq >= 5")  # the newest whole batch
    assert _verify(url)[0] == 0  # the chain alone cannot show it
    code, out = _verify(url, anchors)
    assert code == 1 and out.startswith("BROKEN: truncated record at end of chain"), out
    assert "saw seq 6; the store ends at seq 4 (a cut-off tail)" in out


@pytest.mark.parametrize("forgery", ["no MAC", "edited", "another key"])
def test_an_anchor_forged_or_edited_without_the_key_is_a_break_and_its_heads_are_not_used(
    tmp_path: Path, audit_key: bytes, forgery: str
) -> None:
    from mrtr_keys.audit.writing.chain_key import ChainKey

    url, anchors = f"sqlite://{tmp_path}/audit.db", tmp_path / "anchors.jsonl"
    sink = _sink(url, audit_key)
    sink.write_now(known_events(4))
    assert Anchorer(sink, str(anchors), every=60).run_once()
    sink.close()
    record = json.loads(anchors.read_text())
    record["heads"][0]["seq"] = 2  # a head that would hide a later cut
    if forgery == "no MAC":
        del record["mac"]
    elif forgery == "another key":
        ChainKey(os.urandom(32)).sign(record)
    anchors.write_text(json.dumps(record) + "\n")
    code, out = _verify(url, str(anchors))
    assert code == 1 and out.startswith("BROKEN: checkpoint: the anchor of ") and "cannot be trusted" in out, out
    assert {"no MAC": "carries no MAC", "edited": "does not match its content", "another key": "not a key this"}[
        forgery
    ] in out


def test_a_store_cut_back_to_before_its_switch_with_the_switch_record_is_caught_by_the_anchor(
    tmp_path: Path, audit_key: bytes
) -> None:
    from bench.audit_log import fill

    url, anchors = f"sqlite://{tmp_path}/audit.db", f"{tmp_path}/anchors/"
    fill(url, 6, tx=3, chains=1, keyed=False, audit_key=audit_key)  # written before keyed links
    sink = _sink(url, audit_key)
    sink.write_now(known_events(4))
    assert Anchorer(sink, anchors, every=60).run_once()
    sink.close()
    sqlite_exec(url, "DELETE FROM audit_events WHERE id > 6", "DELETE FROM store_meta WHERE name = 'chain_switch'")
    code, out = _verify(url)
    assert code == 0 and "(0 keyed, 6 unkeyed" in out, out  # what the store alone still shows
    code, out = _verify(url, anchors)
    assert code == 1, out
    assert "the store's switch to keyed links is not the one the record of" in out and "has none" in out, out
    assert "truncated" in out


def test_a_destination_that_cannot_be_written_is_a_warning_and_a_count_and_the_next_run_recovers(
    tmp_path: Path, audit_key: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    url, place = f"sqlite://{tmp_path}/audit.db", tmp_path / "anchors"
    sink = _sink(url, audit_key)
    sink.write_now(known_events(2))
    place.write_text("a file where the directory should be")
    anchor = Anchorer(sink, f"{place}/", every=60)
    with caplog.at_level(logging.WARNING, logger="mrtr_keys.audit.verifying.anchor"):
        assert not anchor.run_once() and not anchor.run_once()
    status = anchor.status()
    assert (
        status["failures"] == 2 and status["last_success"] is None and f"cannot append to {place}/" in status["error"]
    )
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "sealing goes on" in caplog.records[0].message
    sink.write_now(known_events(4)[2:])  # the caller never noticed
    place.unlink()
    assert anchor.run_once() and anchor.status()["error"] is None and anchor.status()["anchors"] == 1
    sink.close()
    shutil.rmtree(place)
