"""One wait, the true one (issue 23): ``rotate retire --json``, its message and ``rotate status --json`` name the
same gates and the same longest wait, and waiting exactly that long lets the retire through.

A grid of ring TTL, time since the promote and the old kid's last seal (none; before ``begin``, by an
instance that already had the newest ring; after the promote, by an instance that lags). A seal before the
promote never makes retire wait (it expires before the TTL gate opens) and never names an instance.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.audit.capture import observer as observer_mod
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.errors import NotYet
from mrtr_keys.factory import request_state_security
from mrtr_keys.fleet.gates import rotation_gate_for
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import utcnow
from tests.fixtures.audit import cli


def _seal_at(codec: Any, when: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observer_mod, "_now", lambda: when)
    codec.seal(b"old key")
    monkeypatch.setattr(observer_mod, "_now", __import__("time").time)
    assert codec._observer.sink.flush()


@pytest.mark.parametrize("ttl", [30.0, 600.0])
@pytest.mark.parametrize("promoted_ago", ["recent", "almost_open"])
@pytest.mark.parametrize("seal", [None, "before_begin", "after_promote"])
def test_retire_and_status_agree_on_the_longest_wait(
    tmp_path: Path, ttl: float, promoted_ago: str, seal: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ring = tmp_path / "keyring.json"
    store = FileKeystore(ring)
    assert cli("init", "--ttl", f"{ttl:g}", keystore=ring).code == 0
    sealer = request_state_security(ring, audience="svc", reload_every=0, instance="sealer", ttl=ttl).codec
    sealer.presence.stop()  # only the audit log's seal events speak for it
    now = utcnow()
    ago = 10.0 if promoted_ago == "recent" else ttl + 50  # TTL gate: ttl + 50 s left, or 10 s
    run_step(store, "begin", now=now - timedelta(seconds=ago + 2))
    run_step(store, "promote", now=now - timedelta(seconds=ago))
    expected = ttl + 60 - ago
    if seal == "before_begin":
        _seal_at(sealer, now.timestamp() - ago - 3, monkeypatch)
    elif seal == "after_promote":
        _seal_at(sealer, now.timestamp() - 2, monkeypatch)
        expected = max(expected, ttl - 2)

    started = time.monotonic()
    retire = cli("rotate", "retire", "--json", keystore=ring)
    status = cli("rotate", "status", "--json", keystore=ring).json()
    between = time.monotonic() - started  # status was evaluated at most this long after retire
    elapsed = (utcnow() - now).total_seconds()  # the expected wait was counted from `now`
    assert retire.code == 75
    refusal = retire.json()
    assert expected - elapsed - 0.1 <= refusal["wait_seconds"] <= expected + 0.1
    assert refusal["wait_seconds"] - between - 0.1 <= status["wait_seconds"] <= refusal["wait_seconds"] + 0.1
    gates = ["TTL", "old key sealing"] if seal == "after_promote" else ["TTL"]
    assert sorted(w["for"] for w in status["waits"]) == sorted(w["for"] for w in refusal["waits"]) == sorted(gates)
    assert f"{math.ceil(refusal['wait_seconds'])} s" in refusal["error"]
    if seal == "before_begin":
        assert "sealer" not in retire.err and "still sealing" not in retire.err

    gate = rotation_gate_for(store)
    with pytest.raises(NotYet):
        run_step(store, "retire", now=now + timedelta(seconds=expected - 1), gate=gate)
    done = run_step(store, "retire", now=now + timedelta(seconds=expected + 0.5), gate=gate)
    assert done.changed and not done.forced
