"""The sidecar and a library codec switch generations by one rule (`mrtr_keys.codecs.generations`).

Given the same sequence of stored rings (a newer generation, an older one, another ring_id, the same
generation with other keys, a corrupt document, a newer one again), the sidecar's `RingState` and a
`LocalAESGCMCodec` end each step on the same generation with the same refusal, and report the same
generations (our decision, issue 25: one reload contract; docs/architecture.md, journey 2).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.errors import MrtrKeysError
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.service.reload import RingState


class Loads:
    def __init__(self) -> None:
        self.generations: list[int] = []

    def sealed(self, kid: str, token: str) -> None: ...

    def unsealed(self, kid: str, token: str) -> None: ...

    def rejected(self, kid: str | None, token: str, reason: str) -> None: ...

    def ring_loaded(self, generation: int, kid: str | None = None) -> None:
        self.generations.append(generation)


def test_the_sidecar_and_a_library_codec_end_in_the_same_state_after_the_same_rings(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    store = FileKeystore(path)
    create_ring(store, audiences=("svc",))
    g1 = tmp_path / "g1.json"
    shutil.copyfile(path, g1)
    other = tmp_path / "other.json"
    create_ring(FileKeystore(other), audiences=("svc",))
    twin = tmp_path / "twin.json"  # generation 2 of this ring, with another new key than the one loaded
    shutil.copyfile(path, twin)
    twin.chmod(0o600)
    run_step(FileKeystore(twin), "begin")
    run_step(FileKeystore(other), "begin")
    run_step(FileKeystore(other), "promote")  # generation 3 of another ring

    loads = Loads()
    codec = LocalAESGCMCodec(path, audience="svc", observer=loads)
    sidecar = RingState(FileKeystore(path))
    sidecar_loaded = [sidecar.ring.generation]

    def step(write: object) -> tuple[int, str | None, bool]:
        if isinstance(write, Path):
            shutil.copyfile(write, path)
        elif isinstance(write, str):
            run_step(store, write)
        else:
            path.write_text("{not a key ring")
        try:
            codec_switched, codec_error = codec.reload(), None
        except MrtrKeysError as exc:
            codec_switched, codec_error = False, str(exc)
        if sidecar.reload(["svc"]):
            sidecar_loaded.append(sidecar.ring.generation)
        assert (sidecar.ring.generation, sidecar.refused) == (codec.generation, codec.reload_refused)
        assert sidecar.error == codec_error
        return codec.generation, codec.reload_refused, codec_switched

    assert step("begin") == (2, None, True)
    backup_of_2 = tmp_path / "g2.json"
    shutil.copyfile(path, backup_of_2)
    generation, refused, switched = step(g1)  # an older generation: refused by both
    assert (generation, switched) == (2, False) and refused is not None and "older" in refused
    generation, refused, switched = step(other)  # another ring_id, higher generation: refused by both
    assert (generation, switched) == (2, False) and refused is not None and "another ring" in refused
    sealed_by_2 = codec.seal(b"sealed under generation 2")
    generation, refused, switched = step(twin)  # generation 2 again, other keys: refused (issue 22)
    assert (generation, switched) == (2, False) and refused is not None and "like the loaded one" in refused
    assert codec.unseal(sealed_by_2) == b"sealed under generation 2"  # the last good ring kept
    generation, refused, switched = step(None)  # corrupt: both keep generation 2 and say why
    assert (generation, switched) == (2, False) and sidecar.error is not None
    generation, refused, switched = step(backup_of_2)  # the ring in use again: unchanged, refusal cleared
    assert (generation, refused, switched) == (2, None, False) and sidecar.error is None
    assert step("promote") == (3, None, True)
    assert loads.generations == sidecar_loaded == [1, 2, 3]
    assert codec.unseal(sidecar.open("svc").seal(b"x")) == b"x"
