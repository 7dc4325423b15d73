"""A revoke racing a rotation on a shared Vault KV ring (issue 37): two runners on two hosts (two state
directories, so no common lock) read the same generation; compare-and-swap lets exactly one write, and the
other fails with `ConflictError` (exit 1, ``mrtr-keys`` says the ring changed) having changed nothing.

The race is made exact, not hoped for: the losing change's transform lets the winner write in between its
read and its save, on a real OpenBao."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrtr_keys.backends import backend_for
from mrtr_keys.changes.apply import ChangeResult, apply_change
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.revoke import revoke
from mrtr_keys.changes.rotation import run_step, transition
from mrtr_keys.errors import ConflictError
from mrtr_keys.keystores.vault_kv import VaultKVKeystore
from mrtr_keys.providers.vault.client import VaultClient, VaultSettings
from mrtr_keys.ring.model import KeyRing, KeyState
from tests.fixtures.openbao import OpenBao


def _hosts(openbao: OpenBao, tmp_path: Path) -> tuple[VaultKVKeystore, VaultKVKeystore]:
    client = VaultClient(VaultSettings(addr=openbao.addr, token=openbao.token))
    path = f"race/{tmp_path.name}"
    return (
        VaultKVKeystore("secret", path, client=client, state_dir=tmp_path / "host-a"),
        VaultKVKeystore("secret", path, client=client, state_dir=tmp_path / "host-b"),
    )


def _revoke(ring: KeyRing, at: object) -> ChangeResult:
    return revoke(ring, ring.primary.kid, at, reason="leak", by="ops@a", backend=backend_for(ring.codec))  # type: ignore[arg-type]


def test_a_begin_that_lands_first_makes_the_revoke_fail_and_change_nothing(openbao: OpenBao, tmp_path: Path) -> None:
    a, b = _hosts(openbao, tmp_path)
    first = create_ring(a).ring

    def revoke_after_the_other_wrote(ring: KeyRing, at: object) -> ChangeResult:
        assert ring.generation == 1
        run_step(b, "begin")  # the other runner saves generation 2 meanwhile
        return _revoke(ring, at)

    with pytest.raises(ConflictError):
        apply_change(a, "revoke", revoke_after_the_other_wrote)
    stored = a.load()
    assert stored.generation == 2 and stored.primary.kid == first.primary.kid
    assert all(k.state is not KeyState.REVOKED for k in stored.keys)  # the revoke changed nothing
    assert apply_change(a, "revoke", _revoke).ring.generation == 3  # run again on what is there: it applies


def test_a_revoke_that_lands_first_makes_the_begin_fail_and_change_nothing(openbao: OpenBao, tmp_path: Path) -> None:
    a, b = _hosts(openbao, tmp_path)
    first = create_ring(a).ring

    def begin_after_the_other_wrote(ring: KeyRing, at: object) -> ChangeResult:
        apply_change(b, "revoke", _revoke)  # the incident response wins the race
        return transition("begin", ring, at)  # type: ignore[arg-type]

    with pytest.raises(ConflictError):
        apply_change(a, "begin", begin_after_the_other_wrote)
    stored = a.load()
    revoked = stored.lookup(first.primary.kid)
    assert stored.generation == 2 and revoked is not None and revoked.state is KeyState.REVOKED
    assert len(stored.keys) == 2  # the revoke's new primary; the begin's key was never written
