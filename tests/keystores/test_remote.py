"""Every keystore by URL: file, Vault KV v2 (``vault-kv://``) and Secrets Manager (``aws-sm://``)
behave alike: `init` through the CLI, the rotation matrix across four generations, `inspect`; a stored
ring is replaced only by compare-and-swap on what the writer read; `revision()` changes exactly when the
ring does. Real servers: the OpenBao dev server and moto in server mode."""

from __future__ import annotations

import pytest
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.errors import ConflictError, KeyRingExists, KeyRingNotFound
from mrtr_keys.factory import build_codec
from tests.fixtures.common import run_cli
from tests.fixtures.keyrings import fresh_ring
from tests.fixtures.keystores import KeystoreUnderTest

AUD = "billing"


@pytest.mark.e2e
def test_init_rotate_matrix_and_inspect(any_keystore: KeystoreUnderTest) -> None:
    ks = any_keystore
    r = run_cli("init", "--json", "--ttl", "5", keystore=ks.url, env=ks.env)
    assert r.code == 0, r.err
    assert r.json()["keystore"] == ks.url and r.json()["generation"] == 1
    store = ks.open()
    codecs = [build_codec(store, audience=AUD)]  # one codec per generation: no watcher, no fence, never current
    for step in ("begin", "promote", "retire"):
        assert run_step(store, step, force=step == "retire").changed
        codecs.append(build_codec(store, audience=AUD))
    assert [c.generation for c in codecs] == [1, 2, 3, 4]  # type: ignore[attr-defined]
    # Generations 1-2 seal with OLD, 3-4 with NEW; OLD opens in 1-3, NEW in 2-4.
    tokens = [c.seal(f"gen{i + 1}".encode()) for i, c in enumerate(codecs)]
    for i, token in enumerate(tokens):
        accepted_by = {0, 1, 2} if i < 2 else {1, 2, 3}
        for j, opener in enumerate(codecs):
            if j in accepted_by:
                assert opener.unseal(token) == f"gen{i + 1}".encode(), (i + 1, j + 1)
            else:
                with pytest.raises(InvalidRequestState):
                    opener.unseal(token)
    r = run_cli("inspect", tokens[0], "--json", keystore=ks.url, env=ks.env)
    assert r.code == 0, r.err
    assert r.json()["state"] == "retired" and r.json()["kid"] == codecs[0].ring.primary.kid  # type: ignore[attr-defined]


def test_a_stale_writer_loses_and_nothing_is_overwritten(any_keystore: KeystoreUnderTest) -> None:
    """Compare-and-swap (Vault ``cas``, Secrets Manager's AWSCURRENT move, the file's lock): a writer
    that read generation 1 cannot save after another writer saved generation 2."""
    a, b = any_keystore.open(), any_keystore.open(any_keystore.state_dir / "other")
    ring = fresh_ring()
    a.create(ring)
    with pytest.raises(KeyRingExists, match="never overwritten"):
        b.create(fresh_ring())
    assert b.load() == ring
    first = ring.next_generation(audiences=("a",))
    b.save(first, expected_generation=1)
    with pytest.raises(ConflictError, match="nothing was written"):
        a.save(ring.next_generation(audiences=("b",)), expected_generation=1)
    assert a.load() == first and b.load() == first
    with pytest.raises(ConflictError):
        a.save(first, expected_generation=2)  # a save must raise the generation


def test_revision_changes_exactly_when_the_ring_does(remote_keystore: KeystoreUnderTest) -> None:
    store = remote_keystore.open()
    assert store.revision() is None  # type: ignore[attr-defined]
    with pytest.raises(KeyRingNotFound, match=f"mrtr-keys init --keystore {remote_keystore.url}"):
        store.load()
    create_ring(store)
    first = store.revision()  # type: ignore[attr-defined]
    assert first is not None and store.revision() == first  # type: ignore[attr-defined]
    store.load()
    assert store.revision() == first  # type: ignore[attr-defined]
    run_step(store, "begin")
    assert store.revision() not in (None, first)  # type: ignore[attr-defined]


@pytest.mark.e2e
def test_state_lives_in_the_state_directory_never_beside_a_remote_ring(remote_keystore: KeystoreUnderTest) -> None:
    """The CLI's audit log and the client registry go to MRTR_KEYS_STATE_DIR."""
    ks = remote_keystore
    assert run_cli("init", keystore=ks.url, env=ks.env).code == 0
    r = run_cli("clients", "add", "web", "--audience", AUD, keystore=ks.url, env=ks.env)
    assert r.code == 0, r.err
    assert sorted(p.name for p in ks.state_dir.iterdir() if not p.name.endswith(".lock")) == [
        "audit.db",
        "audit.key",
        "clients.json",
    ]
