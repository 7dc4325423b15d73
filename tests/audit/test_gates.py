"""Rotation gates from the audit log: promote waits for every live instance to load phase 1; retire waits
while the old kid still seals; --force overrides either and is recorded as forced."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from mrtr_keys.audit import observer as observer_mod
from mrtr_keys.audit.events import instance_id
from mrtr_keys.factory import request_state_security
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import utcnow
from mrtr_keys.ring.rotation import run_step
from tests.fixtures.audit import cli
from tests.fixtures.common import run_cli


@pytest.mark.parametrize("codec", ["local", "vault-remote", "vault-datakey"])
def test_promote_refuses_while_a_live_instance_lacks_phase_1_then_allows(
    tmp_path: Path, codec: str, request: pytest.FixtureRequest
) -> None:
    """Every key-ring codec reports the generation it loads, at start and on reload (one lifecycle):
    an instance that did not reload holds promote back, the same instance reloaded lets it through."""
    ring = tmp_path / "keyring.json"
    init = ["init"]
    if codec != "local":
        request.getfixturevalue("bao_env")
        key = request.getfixturevalue("transit_key")
        init += ["--codec", "vault-transit", "--transit-key", key, "--mode", codec.removeprefix("vault-")]
    assert cli(*init, keystore=ring).code == 0
    sec = request_state_security(ring, audience="svc")  # this process: ring-loaded generation 1
    sec.codec.seal(b"x")
    assert cli("rotate", "begin", keystore=ring).code == 0  # generation 2
    res = run_cli("rotate", "promote", keystore=ring)  # the real console script
    assert res.code == 75
    assert "have not loaded generation 2" in res.err and instance_id() in res.err
    assert sec.codec.reload()  # ring-loaded generation 2, written before reload() returns
    res = cli("rotate", "promote", "--json", keystore=ring)
    assert res.code == 0, res.err
    assert res.json()["changed"] is True and res.json()["forced"] is False


def test_promote_force_is_recorded_as_forced(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    request_state_security(ring, audience="svc")
    assert cli("rotate", "begin", keystore=ring).code == 0
    assert cli("rotate", "next", keystore=ring).code == 75
    res = cli("rotate", "promote", "--force", "--json", keystore=ring)
    assert res.code == 0 and res.json()["forced"] is True
    events = cli("audit", "query", "--op", "promote", "--json", keystore=ring).json()
    assert [(e["op"], e["reason"], e["generation"]) for e in events] == [("promote", "forced", 3)]


@pytest.mark.parametrize("sealed_ago", [0.0, 3600.0])
def test_retire_refuses_while_the_old_kid_seals_within_ttl(
    tmp_path: Path, sealed_ago: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    assert cli("rotate", "begin", keystore=ring).code == 0
    lagging = request_state_security(ring, audience="svc")  # loads generation 2: OLD still primary here
    old_kid = lagging.codec.ring.primary.kid
    run_step(FileKeystore(ring), "promote", now=utcnow() - timedelta(hours=2))  # time gate long open
    real = observer_mod._now
    monkeypatch.setattr(observer_mod, "_now", lambda: real() - sealed_ago)  # the observer's clock
    lagging.codec.seal(b"still sealing with the old key")
    monkeypatch.setattr(observer_mod, "_now", real)
    assert lagging.codec._observer.sink.flush()  # type: ignore[attr-defined]
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
