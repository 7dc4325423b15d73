"""Key ring changes reach the audit log through listeners passed explicitly (our decision, docs/audit.md):
the CLI passes the audit listener; a library user who passes the same listener gets the same records, and
one who passes none gets none. The CLI never writes the environment to share its --audit choice."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.audit.ring_changes import change_listener
from mrtr_keys.changes import scope
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.errors import NotYet
from mrtr_keys.fleet.gates import rotation_gate_for
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import utcnow
from tests.fixtures.audit import cli


def _ops(keystore: Path, *extra: str) -> list[tuple[Any, ...]]:
    res = cli("audit", "query", "--json", *extra, keystore=keystore)
    assert res.code == 0, res.err
    return [(e["op"], e["generation"]) for e in res.json()]


def test_a_library_user_passing_the_audit_listener_gets_the_records_the_cli_writes(tmp_path: Path) -> None:
    by_cli, by_library = tmp_path / "cli" / "keyring.json", tmp_path / "lib" / "keyring.json"
    for args in (("init",), ("rotate", "begin"), ("audience", "add", "svc")):
        assert cli(*args, keystore=by_cli).code == 0
    store = FileKeystore(by_library)
    listeners = [change_listener()]
    create_ring(store, listeners=listeners)
    run_step(store, "begin", listeners=listeners)
    scope.add(store, "svc", listeners=listeners)
    assert _ops(by_library) == _ops(by_cli) == [("init", 1), ("begin", 2), ("audience", 3)]


def test_without_a_listener_a_change_is_saved_and_not_recorded(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    assert cli("init", keystore=path).code == 0
    run_step(FileKeystore(path), "begin")
    assert FileKeystore(path).load().generation == 2
    assert _ops(path) == [("init", 1)]


def test_rotation_gate_for_reads_the_rings_audit_store(tmp_path: Path) -> None:
    """No audit.db yet: no gate (only the time gate). Once an instance is present on generation 1,
    promote after begin is refused until it loads generation 2."""
    path = tmp_path / "keyring.json"
    store = FileKeystore(path)
    create_ring(store)
    assert rotation_gate_for(store) is None
    assert rotation_gate_for(store, audit="off") is None
    from mrtr_keys import request_state_security

    sec = request_state_security(path, audience="svc", reload_every=0)  # presence: generation 1
    run_step(store, "begin", listeners=[change_listener()])
    gate = rotation_gate_for(store)
    assert gate is not None
    with pytest.raises(NotYet, match="have not loaded generation 2"):
        gate("promote", store.load(), utcnow())
    assert sec.codec.reload() and sec.codec.presence.beat()  # the heartbeat its thread writes within 0.5 s
    gate("promote", store.load(), utcnow())


def test_the_root_audit_option_is_passed_on_never_written_to_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mrtr_keys.cli.main import run

    path, log = tmp_path / "keyring.json", tmp_path / "changes.jsonl"
    monkeypatch.delenv("MRTR_KEYS_AUDIT", raising=False)
    monkeypatch.delenv("MRTR_KEYS_LOG_FORMAT", raising=False)
    before = dict(os.environ)
    for args in (["init"], ["rotate", "begin"]):
        root = ["mrtr-keys", "--audit", f"jsonl://{log}"]
        monkeypatch.setattr(sys, "argv", [*root, *args, "--keystore", str(path)])
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exit_:
            run()
        assert exit_.value.code == 0
        assert dict(os.environ) == before
    assert _ops(path, "--audit", f"jsonl://{log}") == [("init", 1), ("begin", 2)]
    assert not (tmp_path / "audit.db").exists()  # nothing went to the default store
