"""`mrtr-keys --state-dir DIR`: the directory is passed on to what opens the keystore, never written to
the environment (children inherit an environment; settings travel explicitly)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import pytest


def test_the_state_dir_option_places_local_files_and_leaves_the_environment_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mrtr_keys.cli.main import run

    ring, state = tmp_path / "ring" / "keyring.json", tmp_path / "state"
    monkeypatch.delenv("MRTR_KEYS_STATE_DIR", raising=False)
    monkeypatch.delenv("MRTR_KEYS_AUDIT", raising=False)
    before = dict(os.environ)
    for args in (["init"], ["rotate", "begin"], ["clients", "add", "billing", "--audience", "billing"]):
        monkeypatch.setattr(sys, "argv", ["mrtr-keys", "--state-dir", str(state), *args, "--keystore", str(ring)])
        with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exit_:
            run()
        assert exit_.value.code == 0
        assert dict(os.environ) == before
    assert {"audit.db", "audit.key", "clients.json"} <= {p.name for p in state.iterdir()}
    assert not (ring.parent / "audit.db").exists() and not (ring.parent / "clients.json").exists()
