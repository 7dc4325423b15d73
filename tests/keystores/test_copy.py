"""`mrtr-keys keystore copy SRC DST`: same ring_id and generation, refuses to overwrite a newer
ring or another ring, prints kids and states and never material."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.errors import ConflictError
from mrtr_keys.keystores.copy import copy_ring
from mrtr_keys.keystores.file import FileKeystore
from tests.fixtures.codec_contract import ring_secrets
from tests.fixtures.common import run_cli
from tests.fixtures.keystores import KeystoreUnderTest

pytestmark = pytest.mark.e2e


def test_copy_a_file_ring_into_a_remote_keystore_and_forward(
    remote_keystore: KeystoreUnderTest, tmp_path: Path
) -> None:
    ks = remote_keystore
    source = FileKeystore(tmp_path / "keyring.json")
    create_ring(source)
    run_step(source, "begin")
    ring = source.load()
    r = run_cli("keystore", "copy", str(source.path), ks.url, env=ks.env)
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0] == f"copied key ring {ring.ring_id} generation 2 to {ks.url}"
    assert sorted(lines[1:]) == sorted(f"  {k.kid}  {k.state.value}" for k in ring.keys)
    for secret in ring_secrets(source.path):
        assert secret not in r.out + r.err
    assert ks.open().load() == ring

    # Again: nothing to do. After a rotation at the source: a compare-and-swap forward.
    assert copy_ring(source, ks.open()).changed is False
    run_step(source, "promote")
    forward = copy_ring(source, ks.open()).describe()
    assert forward["replaced_generation"] == 2 and forward["generation"] == 3
    assert ks.open().load() == source.load()

    # The other way round would go back a generation: refused, nothing written.
    older = FileKeystore(tmp_path / "older.json")
    older.path.write_bytes(ring.dumps())
    older.path.chmod(0o600)
    r = run_cli("keystore", "copy", str(older.path), ks.url, env=ks.env)
    assert r.code == 1 and "holds generation 3" in r.err and "nothing was copied" in r.err
    assert len(r.err.splitlines()) == 1 and ks.open().load().generation == 3

    # Another ring: refused.
    other = FileKeystore(tmp_path / "other.json")
    create_ring(other)
    with pytest.raises(ConflictError, match="holds another key ring"):
        copy_ring(other, ks.open())
    assert ks.open().load() == source.load()
