"""The one key-ring codec lifecycle (`mrtr_keys.codecs.base.KeyRingCodec`) as every ring codec shows it.

Rules under test (our decisions, docs/rotation.md): a reload only moves forward on the same ring (a lower
generation or another ring_id is refused, the loaded ring keeps sealing, a WARNING says why and
`reload_refused` keeps it for readiness); every codec reports each generation it loads; whether a codec
calls out per token is its `remote_per_token` attribute, which the sidecar reads to choose inline or
worker-thread execution; a token that is not a str is rejected without passing it to the observer.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs.base import KeyRingCodec
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.codecs.sidecar_client import SidecarCodec
from mrtr_keys.codecs.vault_transit import VaultTransitCodec
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import CodecSpec
from mrtr_keys.service.reload import RingState
from tests.fixtures.sdk_keys import new_sdk_key, sdk_ring

CODECS = ["local", "vault-remote", "vault-datakey"]


def _spec(kind: str, request: pytest.FixtureRequest) -> CodecSpec:
    if kind == "local":
        return CodecSpec("local")
    request.getfixturevalue("bao_env")
    key = request.getfixturevalue("transit_key")
    return CodecSpec("vault-transit", {"key": key, "mode": kind.removeprefix("vault-")})


def _open(kind: str, path: Path, observer: object = None) -> KeyRingCodec:
    cls = LocalAESGCMCodec if kind == "local" else VaultTransitCodec
    return cls(path, audience="svc", observer=observer)  # type: ignore[arg-type]


class Loads:
    """An observer that records the generations a codec reports loading, and its rejections."""

    def __init__(self) -> None:
        self.generations: list[int] = []
        self.refused: list[tuple[str | None, str, str]] = []

    def sealed(self, kid: str, token: str) -> None:
        pass

    def unsealed(self, kid: str, token: str) -> None:
        pass

    def rejected(self, kid: str | None, token: str, reason: str) -> None:
        self.refused.append((kid, token, reason))

    def ring_loaded(self, generation: int, kid: str | None = None) -> None:
        self.generations.append(generation)


@pytest.mark.parametrize("kind", CODECS)
def test_reload_refuses_an_older_generation_and_keeps_sealing_with_the_loaded_one(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    path, backup = tmp_path / "keyring.json", tmp_path / "backup.json"
    create_ring(FileKeystore(path), codec=_spec(kind, request))
    shutil.copyfile(path, backup)  # generation 1
    loads = Loads()
    codec = _open(kind, path, loads)
    run_step(FileKeystore(path), "begin")
    assert codec.reload() is True and codec.generation == 2 and codec.reload_refused is None
    token = codec.seal(b"sealed on generation 2")

    shutil.copyfile(backup, path)  # the keystore goes back to generation 1
    with caplog.at_level(logging.WARNING, logger="mrtr_keys.codecs"):
        assert codec.reload() is False
        assert codec.reload() is False  # the same refusal is logged once
    assert codec.generation == 2
    assert codec.reload_refused is not None and "older than the loaded generation 2" in codec.reload_refused
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "generation 1" in caplog.records[0].getMessage()
    assert codec.unseal(token) == b"sealed on generation 2"
    assert codec.unseal(codec.seal(b"still sealing")) == b"still sealing"
    assert loads.generations == [1, 2]  # a refused reload reports nothing

    run_step(FileKeystore(path), "begin")  # from generation 1 on disk: a generation 2 with other keys
    assert codec.reload() is False  # refused too (issue 22): tokens of the loaded generation 2 keep opening
    assert codec.reload_refused is not None and "like the loaded one" in codec.reload_refused
    assert codec.unseal(token) == b"sealed on generation 2"
    run_step(FileKeystore(path), "promote")  # a new generation: the ring moves forward again
    assert codec.reload() is True and codec.reload_refused is None
    assert loads.generations == [1, 2, 3]


@pytest.mark.parametrize("kind", CODECS)
def test_reload_refuses_another_ring(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    path, other = tmp_path / "keyring.json", tmp_path / "other.json"
    spec = _spec(kind, request)
    create_ring(FileKeystore(path), codec=spec)
    create_ring(FileKeystore(other), codec=spec)
    run_step(FileKeystore(other), "begin")  # a higher generation does not make it the same ring
    codec = _open(kind, path)
    ring_id = codec.ring.ring_id
    token = codec.seal(b"x")
    shutil.copyfile(other, path)
    assert codec.reload() is False
    assert codec.ring.ring_id == ring_id and codec.generation == 1
    assert codec.reload_refused is not None and "another ring" in codec.reload_refused
    assert codec.unseal(token) == b"x"


@pytest.mark.parametrize(
    ("kind", "remote", "inline"),
    [("local", False, True), ("vault-remote", True, False), ("vault-datakey", False, True)],
)
def test_remote_per_token_decides_where_the_sidecar_runs_a_codec(
    kind: str, remote: bool, inline: bool, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = tmp_path / "keyring.json"
    create_ring(FileKeystore(path), codec=_spec(kind, request), audiences=("svc",))
    assert _open(kind, path).remote_per_token is remote
    assert RingState(FileKeystore(path)).inline is inline
    assert SidecarCodec.remote_per_token is True


@pytest.mark.parametrize("kind", [*CODECS, "local-sdk"])
@pytest.mark.parametrize("token", [None, b"mk1.AAAA", 12])
def test_a_non_string_token_is_rejected_and_never_handed_to_the_observer(
    kind: str, token: object, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = tmp_path / "keyring.json"
    if kind == "local-sdk":  # a ring adopted from the MCP SDK's keys=[KEY] (its own v1. tokens)
        sdk_ring(path, new_sdk_key())
        kind = "local"
    else:
        create_ring(FileKeystore(path), codec=_spec(kind, request))
    loads = Loads()
    codec = _open(kind, path, loads)
    with pytest.raises(InvalidRequestState):
        codec.unseal(token)  # type: ignore[arg-type]
    assert loads.refused == [(None, "", "malformed")]


class SealedKids(Loads):
    """`Loads` that also keeps the kid of every seal."""

    def __init__(self) -> None:
        super().__init__()
        self.kids: list[str] = []

    def sealed(self, kid: str, token: str) -> None:
        self.kids.append(kid)


@pytest.mark.parametrize("kind", CODECS)
def test_a_bound_seal_kept_before_a_reload_seals_with_the_new_primary_after_it(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Our decision (issue 25): `seal` and `unseal` are ordinary methods that reach the current core, so a
    wrapper or framework that keeps ``codec.seal`` never goes on sealing with a key the ring demoted."""
    path = tmp_path / "keyring.json"
    create_ring(FileKeystore(path), codec=_spec(kind, request))
    seen = SealedKids()
    codec = _open(kind, path, seen)
    seal, unseal = codec.seal, codec.unseal  # kept, as a wrapper would
    old = codec.ring.primary.kid
    seal(b"before")
    run_step(FileKeystore(path), "begin")
    run_step(FileKeystore(path), "promote")
    assert codec.reload() is True
    new = codec.ring.primary.kid
    token = seal(b"after the reload")
    assert new != old and seen.kids == [old, new]
    assert seen.generations == [1, 3]
    assert unseal(token) == b"after the reload"
    assert _open(kind, path).unseal(token) == b"after the reload"
