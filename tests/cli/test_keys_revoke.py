"""``mrtr-keys keys revoke`` (issue 37) as an operator sees it: the estimate of the rounds it breaks before it
writes, ``--yes`` (exit 2 without it and without a terminal), exit 1 for an unknown kid, exit 75 while a live
instance cannot read a revoked key (``--force`` writes anyway, recorded as forced), ``--wait`` naming the
instances that cannot learn of it, ``fleet status`` saying which have applied it, and ``audit query --kid``
showing the refusals that followed, with their own reason and metric label.

Instances are codecs of this process (`mrtr_keys.request_state_security` with reload off, so each reload is
the test's); the CLI runs in-process (`tests.fixtures.audit.cli`) except where the console script matters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mcp.server.mcpserver import InvalidRequestState
from prometheus_client import REGISTRY

from mrtr_keys.audit.events import format_ts
from mrtr_keys.audit.writing.stores.url import default_url, open_store
from mrtr_keys.factory import request_state_security
from mrtr_keys.fleet.instances import InstanceRecord
from tests.fixtures.audit import cli
from tests.fixtures.common import run_cli

AUD = "svc"


def _codec(ring: Path, name: str) -> Any:
    return request_state_security(ring, audience=AUD, reload_every=0, instance=name, heartbeat_every=5).codec


def _ring(tmp_path: Path) -> tuple[Path, str]:
    ring = tmp_path / "keyring.json"
    assert cli("init", "--audience", AUD, keystore=ring).code == 0
    kid = cli("keys", "list", "--json", keystore=ring).json()["keys"][0]["kid"]
    return ring, kid


def test_the_estimate_counts_rounds_sealed_and_not_yet_opened_by_audience_and_instance(tmp_path: Path) -> None:
    ring, kid = _ring(tmp_path)
    a, b = _codec(ring, "web-a"), _codec(ring, "web-b")  # one process: one audit instance, two presence names
    tokens = [a.seal(b"%d" % i) for i in range(5)] + [b.seal(b"b")]
    a.unseal(tokens[0])
    b.unseal(tokens[1])  # opened by another codec: the same fingerprint
    other = _codec(ring, "other")
    assert a._observer.sink.flush(10)
    res = run_cli("keys", "revoke", kid, "--reason", "ring file in a backup", keystore=ring)  # no terminal
    assert res.code == 2
    assert res.out.splitlines() == [
        f"revoking {kid} breaks 4 round(s) sealed under it in the last 600 s and not yet opened "
        f"(audit log sqlite://{tmp_path / 'audit.db'})",
        f"  audience {AUD}, instance other/web-a/web-b: 4",
    ]
    assert other.ring.generation == 1
    assert res.err == f"mrtr-keys: revoking {kid} (primary) is final; add --yes to revoke it\n"
    doc = cli("keys", "revoke", kid, "--reason", "x", "--json", keystore=ring)
    assert doc.code == 2 and doc.json()["estimate"]["rounds"] == 4
    assert cli("keys", "list", "--json", keystore=ring).json()["generation"] == 1  # nothing written


def test_revoke_with_yes_breaks_those_rounds_on_every_instance_and_the_log_shows_why(tmp_path: Path) -> None:
    ring, kid = _ring(tmp_path)
    a, b = _codec(ring, "web-a"), _codec(ring, "web-b")
    token = a.seal(b"in flight")
    assert a._observer.sink.flush(10)
    counted = REGISTRY.get_sample_value("mrtr_keys_rejections_total", {"reason": "revoked kid"}) or 0.0
    res = cli("keys", "revoke", kid, "--reason", "core dump shared", "--yes", "--json", keystore=ring)
    assert res.code == 0, res.err
    doc = res.json()
    assert (doc["step"], doc["changed"], doc["forced"], doc["kid"], doc["was"], doc["material"]) == (
        "revoke",
        True,
        False,
        kid,
        "primary",
        "removed",
    )
    assert doc["estimate"]["rounds"] == 1 and doc["new"] != kid and doc["generation"] == 2
    for codec in (a, b):
        assert codec.reload()
        with pytest.raises(InvalidRequestState, match=r"^revoked kid$"):
            codec.unseal(token)
        assert codec.unseal(codec.seal(b"next")) == b"next"  # the new primary seals at once
    assert REGISTRY.get_sample_value("mrtr_keys_rejections_total", {"reason": "revoked kid"}) == counted + 2
    assert a._observer.sink.flush(10)
    events = cli("audit", "query", "--kid", kid, "--json", keystore=ring).json()
    assert [(e["op"], e["outcome"], e["reason"]) for e in events if e["op"] != "ring-loaded"] == [
        ("init", "ok", None),
        ("seal", "ok", None),
        ("revoke", "ok", "core dump shared"),
        ("unseal", "rejected", "revoked kid"),
        ("unseal", "rejected", "revoked kid"),
    ]
    shown = cli("keys", "show", kid, "--json", keystore=ring).json()
    assert (shown["state"], shown["material"], shown["revoked_reason"]) == ("revoked", "destroyed", "core dump shared")
    again = cli("keys", "revoke", kid, "--reason", "again", "--yes", keystore=ring)
    assert again.code == 0 and "already revoked" in again.out  # final, and saying so is not an error


def test_an_unknown_kid_exits_1_and_a_retired_key_loses_its_material(tmp_path: Path) -> None:
    ring, kid = _ring(tmp_path)
    res = run_cli("keys", "revoke", "0badc0de", "--reason", "x", "--yes", keystore=ring)
    assert res.code == 1 and "no key 0badc0de in key ring" in res.err
    for step in ("begin", "promote", "retire"):
        assert cli("rotate", step, *(["--force"] if step != "begin" else []), keystore=ring).code == 0
    assert cli("keys", "show", kid, "--json", keystore=ring).json()["material"] == "held"
    res = cli("keys", "revoke", kid, "--reason", "old backup leaked", "--yes", "--json", keystore=ring)
    assert res.code == 0 and res.json()["was"] == "retired" and res.json()["estimate"]["rounds"] == 0
    assert cli("keys", "show", kid, "--json", keystore=ring).json()["material"] == "destroyed"


def _old_instance(ring: Path, ring_id: str, name: str, version: str) -> None:
    store: Any = open_store(default_url(ring.parent))
    try:
        now = format_ts(__import__("time").time())
        store.put_instance(
            InstanceRecord(name, "h", 1, "library", "local", ring_id, 1, None, version, now, now, 10.0, "running").row()
        )
    finally:
        store.close()


def test_revoke_refuses_while_a_live_instance_cannot_read_it_unless_forced(tmp_path: Path) -> None:
    ring, kid = _ring(tmp_path)
    ring_id = cli("keys", "list", "--json", keystore=ring).json()["ring_id"]
    _old_instance(ring, ring_id, "legacy-1", "0.1.9")
    res = run_cli("keys", "revoke", kid, "--reason", "leak", "--yes", keystore=ring)
    assert res.code == 75
    assert "legacy-1 (version 0.1.9, cannot read: key state revoked)" in res.err and "--force" in res.err
    assert cli("keys", "list", "--json", keystore=ring).json()["generation"] == 1
    res = cli("keys", "revoke", kid, "--reason", "leak", "--yes", "--force", "--json", keystore=ring)
    assert res.code == 0 and res.json()["forced"] is True and "legacy-1" in res.json()["forced_note"]
    events = cli("audit", "query", "--op", "revoke", "--json", keystore=ring).json()
    assert [e["reason"] for e in events] == ["forced; leak"]


def test_wait_names_an_instance_that_cannot_learn_of_it_and_fleet_status_says_who_applied_it(tmp_path: Path) -> None:
    ring, kid = _ring(tmp_path)
    frozen, live = _codec(ring, "frozen"), _codec(ring, "live")
    res = run_cli("keys", "revoke", kid, "--reason", "leak", "--yes", "--wait", "1", "--json", keystore=ring)
    assert res.code == 75, res.err
    doc = res.json()
    assert doc["changed"] is True and doc["applied"]["done"] is False and doc["applied"]["live"] == 2
    assert {r["name"]: r["note"] for r in doc["applied"]["lagging"]} == {"frozen": "reload off", "live": "reload off"}
    assert "the wait ran out: 0 of 2 live instance(s) applied generation 2" in res.err
    assert "frozen (generation 1, heartbeat" in res.err and "reload off" in res.err
    assert live.reload() and live.presence.beat()
    status = cli("fleet", "status", keystore=ring)
    assert status.code == 0
    text = " ".join(status.out.split())  # notes are wrapped at 80 columns
    assert f"revoked {kid} at " in text and "1 of 2 live instance(s) applied generation 2" in text
    assert "not yet: frozen (generation 1" in text
    rows = {r["name"]: r["applied"] for r in cli("fleet", "status", "--json", keystore=ring).json()}
    assert rows == {"frozen": False, "live": True}
    assert frozen.reload() and frozen.presence.beat()
    rows = {r["name"]: r["applied"] for r in cli("fleet", "status", "--json", keystore=ring).json()}
    assert rows == {"frozen": True, "live": True}


def test_an_audit_store_out_of_reach_writes_nothing_and_says_how_to_revoke_without_it(tmp_path: Path) -> None:
    """An incident whose audit database is down too: the revoke needs the store (estimate, fleet check, record),
    so it writes nothing and exits 75; the message says how to revoke without it (the ring still keeps who,
    when and why), and that works."""
    import socket

    ring, kid = _ring(tmp_path)
    with socket.socket() as held:  # bound and never listening: every connection is refused
        held.bind(("127.0.0.1", 0))
        url = f"postgresql://127.0.0.1:{held.getsockname()[1]}/audit"
        res = cli("--audit", url, "keys", "revoke", kid, "--reason", "leak", "--yes", keystore=ring)
    assert res.code == 75 and res.err.count("\n") == 1, res.err
    assert "nothing written" in res.err
    assert f"mrtr-keys --audit off keys revoke {kid} --reason TEXT --yes" in res.err
    assert cli("keys", "list", "--json", keystore=ring).json()["generation"] == 1
    done = cli("--audit", "off", "keys", "revoke", kid, "--reason", "leak", "--yes", keystore=ring)
    assert done.code == 0 and f"key {kid} revoked (was primary)" in done.out
    key = cli("keys", "show", kid, "--json", keystore=ring).json()
    assert (key["state"], key["revoked_reason"]) == ("revoked", "leak")
