"""`mrtr-keys audit query|stats|export|verify|fingerprint|checkpoint` against known inserted events."""

from __future__ import annotations

import csv
import functools
import io
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.events import FIELDS
from mrtr_keys.codecs.local import LocalAESGCMCodec
from tests.fixtures.audit import cli, insert, known_events
from tests.fixtures.common import run_cli

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key


@pytest.fixture
def filled(keystore_path: Path, make_sink: Callable[..., AuditSink]) -> Path:
    """The ring's default store (audit.db beside it) holding `known_events(6)`."""
    url = f"sqlite://{keystore_path.parent}/audit.db"
    insert(make_sink(url), known_events(6))
    return keystore_path


def test_query_filters_and_json_shape(filled: Path) -> None:
    events = [e.to_json() for e in known_events(6)]
    res = cli("audit", "query", "--json", keystore=filled)
    assert res.code == 0, res.err
    got = res.json()
    assert got == events and all(list(e) == list(FIELDS) for e in got)
    res = cli("audit", "query", "--json", "--kid", "bbbbbbbb", "--outcome", "rejected", keystore=filled)
    assert res.json() == [e for e in events if e["kid"] == "bbbbbbbb" and e["outcome"] == "rejected"]
    res = cli(
        "audit",
        "query",
        "--json",
        "--since",
        "2026-07-28T10:00:01Z",
        "--until",
        "2026-07-28T10:00:04Z",
        keystore=filled,
    )
    assert [e["time"] for e in res.json()] == [e["time"] for e in events[1:4]]
    res = cli("audit", "query", "--json", "--client", "web", "--op", "unseal", keystore=filled)
    assert res.json() == [e for e in events if e["client"] == "web" and e["op"] == "unseal"]
    res = cli("audit", "query", "--json", "--reason", "expired", "--audience", "billing", keystore=filled)
    assert res.json() == [e for e in events if e["reason"] == "expired" and e["audience"] == "billing"]
    res = cli("audit", "query", "--json", "--since", "1h", keystore=filled)
    assert res.code == 0 and res.json() == []  # the known events are dated 2026-07-28
    assert cli("audit", "query", "--since", "yesterday-ish", keystore=filled).code == 2


def test_stats_by_kid_and_reason(filled: Path) -> None:
    res = cli("audit", "stats", "--by", "kid", "--json", keystore=filled)
    assert res.code == 0, res.err
    assert res.json() == [{"key": "aaaaaaaa", "count": 3}, {"key": "bbbbbbbb", "count": 3}]
    res = cli("audit", "stats", "--by", "reason", "--json", keystore=filled)
    assert {r["key"]: r["count"] for r in res.json()} == {None: 4, "expired": 2}
    res = cli("audit", "stats", "--by", "instance", "--since", "2026-07-28T10:00:03Z", "--json", keystore=filled)
    assert sorted((r["key"][:6], r["count"]) for r in res.json()) == [("host-0", 1), ("host-1", 2)]
    assert cli("audit", "stats", "--by", "payload", keystore=filled).code == 2


def test_export_jsonl_and_csv_round_trip(filled: Path, tmp_path: Path) -> None:
    events = [e.to_json() for e in known_events(6)]
    res = cli("audit", "export", "--format", "jsonl", keystore=filled)
    assert res.code == 0, res.err
    lines = [json.loads(line) for line in res.out.splitlines()]
    assert [{k: d[k] for k in FIELDS} for d in lines] == events
    assert [d["seq"] for d in lines] == [1, 2, 3, 4, 5, 6]
    # an export is itself a verifiable store
    out = tmp_path / "export.jsonl"
    out.write_text(res.out)
    assert cli("audit", "verify", "--audit", f"jsonl://{out}", keystore=filled).code == 0
    res = cli("audit", "export", "--format", "csv", keystore=filled)
    rows = list(csv.DictReader(io.StringIO(res.out)))
    assert [r["kid"] for r in rows] == [e["kid"] for e in events]
    assert [r["reason"] or None for r in rows] == [e["reason"] for e in events]


def test_verify_exit_codes_and_checkpoint(filled: Path, tmp_path: Path) -> None:
    ok = run_cli("audit", "verify", keystore=filled)  # the real console script, once
    assert ok.code == 0 and "ok: 6 records in 1 chain" in ok.out
    cp = cli("audit", "checkpoint", "--checkpoints", str(tmp_path / "cp.jsonl"), "--json", keystore=filled)
    assert cp.code == 0 and cp.json()["heads"][0]["seq"] == 6
    db = sqlite3.connect(filled.parent / "audit.db")
    with db:
        db.execute("UPDATE audit_events SET kid = 'cccccccc' WHERE seq = 2")
    res = cli("audit", "verify", "--json", keystore=filled)
    assert res.code == 1
    # the 6 events were written as one batch: an edit shows at the batch's first record
    assert res.json()["first_break"]["kind"] == "altered" and res.json()["first_break"]["seq"] == 1
    assert res.json()["first_break"]["time"] == "2026-07-28T10:00:00.000000Z"
    with db:
        db.execute("UPDATE audit_events SET kid = 'aaaaaaaa' WHERE seq = 2")  # undone: intact again
        db.execute("DELETE FROM audit_events WHERE seq = 6")  # cut the tail
    db.close()
    res = cli("audit", "verify", "--checkpoints", str(tmp_path / "cp.jsonl"), keystore=filled)
    assert res.code == 1 and "BROKEN: truncated" in res.out


def test_the_root_audit_option_beats_the_environment_for_audit_commands(filled: Path, tmp_path: Path) -> None:
    """`mrtr-keys --audit URL audit verify` with MRTR_KEYS_AUDIT set (a CI job's variables, docs/rotation.md) read
    the environment's store instead: the subcommand's own --audit took the variable and won over the root option,
    so a tampered store named on the command line verified "ok" (the other store's result)."""
    tampered = tmp_path / "tampered.db"
    src, db = sqlite3.connect(filled.parent / "audit.db"), sqlite3.connect(tampered)
    src.backup(db)  # a copy, WAL included
    with db:
        db.execute("UPDATE audit_events SET kid = 'cccccccc' WHERE seq = 2")
    src.close(), db.close()
    run = functools.partial(run_cli, keystore=filled, env={"MRTR_KEYS_AUDIT": f"sqlite://{filled.parent / 'audit.db'}"})
    assert run("audit", "verify").code == 0  # the environment's store, intact
    root = run("--audit", f"sqlite://{tampered}", "audit", "verify")
    assert root.code == 1 and root.out.startswith("BROKEN: altered record"), (root.code, root.out, root.err)
    sub = run("audit", "verify", "--audit", f"sqlite://{tampered}")
    assert sub.code == 1 and sub.out.startswith("BROKEN: altered record")
    migrate = run("--audit", f"sqlite://{tmp_path / 'none.db'}", "audit", "migrate")
    assert migrate.code == 2 and f"no audit log at {tmp_path / 'none.db'}" in migrate.err


def test_tail_follow_refuses_an_interval_it_cannot_sleep(filled: Path) -> None:
    """`audit tail -f --interval -1` (or nan, inf) printed the events, then died with 'internal error: ValueError:
    sleep length must be non-negative'; `--interval 0` polled the store in a busy loop (a third of a core)."""
    for value in ("-1", "nan", "inf", "0"):
        res = cli("audit", "tail", "-f", "--interval", value, keystore=filled)
        assert (res.code, res.out, res.err) == (
            2,
            "",
            "mrtr-keys: --interval must be a number of seconds from 0.05 to 86400\n",
        ), value


def test_fingerprint_and_token_query(keystore_path: Path) -> None:
    from mrtr_keys.audit.capture.observer import observer_for

    obs = observer_for(keystore_path.parent, audience="svc")
    assert obs is not None
    codec = LocalAESGCMCodec(keystore_path, audience="svc", observer=obs)
    token = codec.seal(b"secret payload")
    codec.unseal(token)
    other = codec.seal(b"another")
    assert obs.sink.flush()
    fp = cli("audit", "fingerprint", token, keystore=keystore_path)
    assert fp.code == 0 and len(fp.out.strip()) == 24 and token not in fp.out
    life = cli("audit", "query", "--token", token, "--json", keystore=keystore_path).json()
    assert [(e["op"], e["outcome"]) for e in life] == [("seal", "ok"), ("unseal", "ok")]
    assert {e["fingerprint"] for e in life} == {fp.out.strip()}
    assert other not in json.dumps(life)
    tail = cli("audit", "tail", "-n", "2", "--json", keystore=keystore_path).json()
    assert [e["op"] for e in tail] == ["unseal", "seal"]


def test_reading_a_missing_log_says_so(keystore_path: Path) -> None:
    res = cli("audit", "query", keystore=keystore_path)
    assert res.code == 2 and "no audit log at" in res.err
    res = cli("audit", "query", "--audit", "off", keystore=keystore_path)
    assert res.code == 2 and "auditing is off" in res.err


def test_fingerprint_of_a_token_respelled_in_standard_base64_is_the_canonical_tokens(keystore_path: Path) -> None:
    # A token respelled with "+", "/" and "=" padding printed a fingerprint that matched no
    # event; it now gives the fingerprint of the token it spells, and --token finds that token's events.
    import base64

    from mrtr_keys.audit.capture.observer import observer_for

    obs = observer_for(keystore_path.parent, audience="svc")
    assert obs is not None
    codec = LocalAESGCMCodec(keystore_path, audience="svc", observer=obs)
    token = next(t for t in (codec.seal(b"payload %d" % i) for i in range(200)) if "-" in t or "_" in t)
    assert obs.sink.flush()
    head, body = token.split(".", 1)
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    respelled = head + "." + base64.standard_b64encode(raw).decode()
    assert respelled != token
    want = cli("audit", "fingerprint", token, keystore=keystore_path).out.strip()
    assert cli("audit", "fingerprint", respelled, keystore=keystore_path).out.strip() == want
    life = cli("audit", "query", "--token", respelled, "--json", keystore=keystore_path).json()
    assert [(e["op"], e["fingerprint"]) for e in life] == [("seal", want)]


def test_json_nested_deeper_than_the_parser_goes_is_a_verdict_not_an_internal_error(
    filled: Path, tmp_path: Path
) -> None:
    """Whoever writes the store (or a checkpoint file, or a JSON-lines log) could make `audit verify` end in
    ``internal error: RecursionError`` with one value nested 100,000 deep, where any other malformed text is a
    finding: the store's chain_switch record, a checkpoint line, a record of a JSON-lines log. Each is now the
    finding the same damage gets when it is not nested: BROKEN (exit 1), or one line naming the file."""
    deep = "[" * 100_000 + "]" * 100_000
    cp = tmp_path / "cp.jsonl"
    cp.write_text(deep + "\n")
    res = run_cli("audit", "verify", "--checkpoints", str(cp), keystore=filled)
    assert (res.code, res.err) == (2, f"mrtr-keys: {cp}:1: not a checkpoint (bad JSON)\n")

    log = tmp_path / "audit.jsonl"
    log.write_text(deep + "\n")
    res = run_cli("audit", "verify", "--audit", f"jsonl://{log}", keystore=filled)
    assert (res.code, res.err) == (1, f"mrtr-keys: {log}:1: not an audit record\n")

    db = sqlite3.connect(filled.parent / "audit.db")
    with db:
        db.execute("UPDATE store_meta SET value = ? WHERE name = 'chain_switch'", (deep,))
    db.close()
    res = run_cli("audit", "verify", keystore=filled)
    assert res.code == 1 and "internal error" not in res.err, res.err
    assert "BROKEN: store: the chain_switch record in store_meta is malformed" in res.out
