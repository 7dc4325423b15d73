"""Rotation gates from the audit store: promote waits for every live instance to load phase 1; retire waits
for every live instance to load phase 2 and while the old kid still seals; --force or a narrowed --window
overrides either and is recorded as forced.

Instances here are this process's codecs with reload off (`reload_every=0`), so they lag on purpose;
their presence heartbeat is written at once (`codec.presence.beat()`), never waited for.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.audit.capture import observer as observer_mod
from mrtr_keys.audit.events import instance_id
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.factory import request_state_security
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import utcnow
from tests.fixtures.audit import cli
from tests.fixtures.common import run_cli


def _lagging(ring: Path, name: str) -> Any:
    """A codec of this process under presence name `name` that never reloads by itself."""
    return request_state_security(ring, audience="svc", reload_every=0, instance=name).codec


@pytest.mark.parametrize("codec_type", ["local", "vault-remote", "vault-datakey"])
def test_promote_refuses_while_a_live_instance_lacks_phase_1_then_allows(
    tmp_path: Path, codec_type: str, request: pytest.FixtureRequest
) -> None:
    """Every key-ring codec reports the generation it loads, at start and on reload (one lifecycle): an
    instance that did not reload holds promote back and shows in `fleet status`; reloaded, it lets it through."""
    ring = tmp_path / "keyring.json"
    init = ["init"]
    if codec_type != "local":
        request.getfixturevalue("bao_env")
        key = request.getfixturevalue("transit_key")
        init += ["--codec", "vault-transit", "--transit-key", key, "--mode", codec_type.removeprefix("vault-")]
    assert cli(*init, keystore=ring).code == 0
    codec = _lagging(ring, "svc-a")  # presence: generation 1
    codec.seal(b"x")
    assert cli("rotate", "begin", keystore=ring).code == 0  # generation 2
    res = run_cli("rotate", "promote", keystore=ring)  # the real console script
    assert res.code == 75
    assert "have not loaded generation 2" in res.err and "svc-a (generation 1" in res.err
    fleet = cli("fleet", "status", "--json", keystore=ring).json()
    assert [(r["name"], r["status"], r["generation"], r["note"]) for r in fleet] == [("svc-a", "live", 1, "reload off")]
    assert fleet[0]["codec"] == ("local" if codec_type == "local" else "vault-transit")
    assert codec.reload()
    assert codec.presence.beat()  # what the heartbeat thread writes within 0.5 s of the reload
    assert cli("fleet", "status", "--json", keystore=ring).json()[0]["generation"] == 2
    res = cli("rotate", "promote", "--json", keystore=ring)
    assert res.code == 0, res.err
    assert res.json()["changed"] is True and res.json()["forced"] is False


def test_promote_force_is_recorded_as_forced(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    kept = _lagging(ring, "svc-b")
    assert cli("rotate", "begin", keystore=ring).code == 0
    assert cli("rotate", "next", keystore=ring).code == 75
    res = cli("rotate", "promote", "--force", "--json", keystore=ring)
    assert res.code == 0 and res.json()["forced"] is True
    events = cli("audit", "query", "--op", "promote", "--json", keystore=ring).json()
    assert [(e["op"], e["reason"], e["generation"]) for e in events] == [("promote", "forced", 3)]
    assert kept.ring.generation == 1  # held back all along


def test_a_narrowed_window_that_lets_a_step_pass_is_recorded_as_forced(tmp_path: Path) -> None:
    """A narrowed window that lets a step through is an override like --force: recorded as forced."""
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    kept = _lagging(ring, "svc-c")
    assert cli("rotate", "begin", keystore=ring).code == 0
    assert cli("rotate", "promote", "--window", "600", keystore=ring).code == 75  # wider: still counted
    res = cli("rotate", "promote", "--window", "0", "--json", keystore=ring)
    assert res.code == 0, res.err
    assert res.json()["forced"] is True and "--window 0 left out instance(s)" in res.json()["message"]
    events = cli("audit", "query", "--op", "promote", "--json", keystore=ring).json()
    assert [(e["reason"], e["generation"]) for e in events] == [("forced", 3)]
    assert kept.ring.generation == 1


def test_retire_refuses_while_a_live_instance_lacks_phase_2(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    assert cli("rotate", "begin", keystore=ring).code == 0
    codec = _lagging(ring, "svc-d")  # generation 2: still seals with OLD
    run_step(FileKeystore(ring), "promote", now=utcnow() - timedelta(hours=2))  # time gate long open
    res = cli("rotate", "retire", keystore=ring)
    assert res.code == 75
    assert "retire not yet" in res.err and "have not loaded generation 3: svc-d (generation 2" in res.err
    status = cli("rotate", "status", "--json", keystore=ring).json()
    assert status["instances_live"] == 1 and status["instances_ready"] == 0
    assert [w["for"] for w in status["waits"]] == ["instances"]
    assert status["sentence"].endswith("waiting for: instances (svc-d)")
    assert codec.reload() and codec.presence.beat()
    assert cli("rotate", "retire", keystore=ring).code == 0


@pytest.mark.parametrize("sealed_ago", [0.0, 3600.0])
def test_retire_refuses_while_the_old_kid_seals_within_ttl(
    tmp_path: Path, sealed_ago: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    assert cli("rotate", "begin", keystore=ring).code == 0
    lagging = _lagging(ring, "svc-e")  # loads generation 2: OLD still primary here
    old_kid = lagging.ring.primary.kid
    run_step(FileKeystore(ring), "promote", now=utcnow() - timedelta(hours=2))  # time gate long open
    real = observer_mod._now
    monkeypatch.setattr(observer_mod, "_now", lambda: real() - sealed_ago)  # the observer's clock
    lagging.seal(b"still sealing with the old key")
    monkeypatch.setattr(observer_mod, "_now", real)
    assert lagging._observer.sink.flush()
    lagging.presence.stop()  # out of presence: only the audit log's seal events speak for it now
    res = cli("rotate", "retire", keystore=ring)
    if sealed_ago:
        assert res.code == 0, res.err  # last old-kid seal is older than the TTL (600 s): allowed
        return
    assert res.code == 75
    assert f"the audit log shows {old_kid} still sealing" in res.err and instance_id() in res.err
    res = cli("rotate", "next", "--force", "--json", keystore=ring)
    assert res.code == 0 and res.json()["step"] == "retire" and res.json()["forced"] is True
    retired = cli("audit", "query", "--op", "retire", "--json", keystore=ring).json()
    assert [(e["kid"], e["reason"]) for e in retired] == [(old_kid, "forced")]


def test_a_stopped_instance_does_not_hold_promote(tmp_path: Path) -> None:
    """After a clean restart, promote is not held by the names of processes that are gone."""
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    codec = _lagging(ring, "svc-f")
    assert cli("rotate", "begin", keystore=ring).code == 0
    assert cli("rotate", "promote", keystore=ring).code == 75
    codec.presence.stop()  # what SIGTERM or interpreter exit writes
    fleet = cli("fleet", "status", "--json", keystore=ring).json()
    assert [(r["name"], r["status"], r["generation"]) for r in fleet] == [("svc-f", "stopped", 1)]
    assert cli("rotate", "promote", keystore=ring).code == 0
