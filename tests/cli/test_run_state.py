"""`make run`'s state (`mrtr_keys.run.prepare`): the demo client's secret file."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from mrtr_keys.run import SECRET_FILE, prepare
from mrtr_keys.service.clients import load_registry, remove_client


def test_a_reissued_secret_file_is_mode_0600_even_where_the_old_one_was_wider(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo client's secret is reissued when the registry lost the client; the old file, chmod 644 by
    someone, was truncated and rewritten in place and kept 644 while the message said 0600."""
    monkeypatch.delenv("MRTR_KEYS_CLIENTS", raising=False)
    state = tmp_path / ".mrtr"
    _, registry, secret_path = prepare(state)
    first = secret_path.read_text()
    secret_path.chmod(0o644)
    remove_client(registry, "demo")
    assert load_registry(registry).get("demo") is None
    prepare(state)
    assert stat.S_IMODE(secret_path.stat().st_mode) == 0o600
    assert secret_path.read_text() != first
    assert sorted(p.name for p in state.iterdir() if p.name.startswith(f".{SECRET_FILE}")) == []
