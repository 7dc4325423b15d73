"""The codec pin holds against a swapped ring (issue 39, item 9), for library codecs.

Threat: someone who can write the keystore but cannot use its KMS key replaces a KMS ring by a ``local`` ring
of keys they chose (same ``ring_id``, the next generation). The backend is chosen from the ring's own record,
so before the pin an instance pinned to a KMS key (``MRTR_KEYS_KMS_KEY_ID``) loaded it at start and then
accepted tokens forged with those keys. Now a process with a pin (``kms_key_id=`` / ``MRTR_KEYS_KMS_KEY_ID``,
``expect_codec=`` / ``MRTR_KEYS_EXPECT_CODEC``) refuses a ring of another codec type or KMS key: at start with
a one-line `ConfigError` (exit 2 from the example server), on reload like an older generation (the last good
ring stays and ``reload_refused`` says why). The sidecar's side is tests/service/test_reload_pin.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.changes.create import create_ring
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.codecs.pin import RingPin
from mrtr_keys.errors import ConfigError
from mrtr_keys.factory import open_codec
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import CodecSpec
from tests.fixtures.keyrings import fresh_ring, swap_for_a_local_ring
from tests.fixtures.moto_kms import KMSEnv
from tests.support import zygote

AUD = "svc"
ARN = "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"


def _kms_ring(tmp_path: Path, arn: str, name: str = "ring.json") -> FileKeystore:
    store = FileKeystore(tmp_path / name)
    create_ring(store, codec=CodecSpec("kms", {"kms_key_id": arn}))
    return store


@pytest.mark.parametrize(
    ("env", "kwargs", "source"),
    [
        ({"MRTR_KEYS_KMS_KEY_ID": ARN}, {}, "MRTR_KEYS_KMS_KEY_ID"),
        ({}, {"kms_key_id": ARN}, "kms_key_id"),
        ({"MRTR_KEYS_EXPECT_CODEC": "kms"}, {}, "MRTR_KEYS_EXPECT_CODEC"),
        ({}, {"expect_codec": "kms"}, "expect_codec"),
    ],
    ids=["env-kms-key", "kms_key_id", "env-expect", "expect_codec"],
)
def test_a_pinned_instance_refuses_a_local_ring_at_start(
    keystore_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], kwargs: dict[str, str], source: str
) -> None:
    for name in ("MRTR_KEYS_KMS_KEY_ID", "MRTR_KEYS_EXPECT_CODEC"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ring = FileKeystore(keystore_path).load()
    with pytest.raises(ConfigError) as info:
        open_codec(keystore_path, audience=AUD, reload_every=0, **kwargs)
    assert str(info.value) == (
        f"refused: key ring {ring.ring_id} generation 1 is a 'local' ring, but {source} lets this process load "
        "only 'kms' rings (was the keystore rewritten by someone who cannot use the expected keys?)"
    )
    assert "\n" not in str(info.value)


@pytest.mark.e2e  # the example server in its own process
def test_the_example_server_exits_2_with_one_line(keystore_path: Path, tmp_path: Path) -> None:
    """In its own process (the example server hardens the process it runs in)."""
    out, err = tmp_path / "out", tmp_path / "err"
    argv = [sys.executable, "-m", "mrtr_keys.example", "--keystore", str(keystore_path), "--port", "1"]
    env = {**os.environ, "MRTR_KEYS_KMS_KEY_ID": ARN}
    with open(out, "w") as o, open(err, "w") as e:
        proc = zygote.popen(argv, stdout=o, stderr=e, env=env) or subprocess.Popen(argv, stdout=o, stderr=e, env=env)
    assert proc.wait(60) == 2
    # runpy's warning that the zygote had imported the module already is the zygote's, not the server's
    lines = [line for line in err.read_text().splitlines() if not line.startswith("<frozen runpy>")]
    assert len(lines) == 1 and "is a 'local' ring, but MRTR_KEYS_KMS_KEY_ID lets this process load" in lines[0]


def test_an_expected_codec_admits_its_own_rings(keystore_path: Path) -> None:
    codec = open_codec(keystore_path, audience=AUD, reload_every=0, expect_codec="local")
    assert codec.unseal(codec.seal(b"x")) == b"x"


@pytest.mark.parametrize(
    ("expect", "key", "message"),
    [
        ("aes", None, "expect_codec 'aes' is not a codec type (one of: kms, local, vault-transit)"),
        ("local", ARN, "kms_key_id pins a KMS key, but expect_codec expects 'local' rings"),
    ],
)
def test_a_pin_that_cannot_hold_is_refused(keystore_path: Path, expect: str, key: str | None, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_codec(keystore_path, audience=AUD, reload_every=0, expect_codec=expect, kms_key_id=key)
    assert str(info.value) == message


def test_a_kms_key_pin_refuses_a_ring_under_another_key() -> None:
    """An alias of the pin (a bare key id) matches its ARN; another key's ARN does not."""
    ring = replace(fresh_ring(), codec=CodecSpec("kms", {"kms_key_id": ARN}))
    assert RingPin.from_settings(kms_key_id=ARN.rsplit("/", 1)[1], environ={}).refusal(ring) is None
    other = ARN.replace("1234abcd", "5678efgh")
    assert RingPin.from_settings(kms_key_id=other, environ={}).refusal(ring) == (
        f"key ring {ring.ring_id} generation 1 is wrapped under KMS key {ARN}, but kms_key_id lets this "
        f"process load only rings wrapped under {other}"
    )


def test_a_pinned_kms_codec_keeps_its_ring_when_it_is_swapped_for_a_local_one(kms: KMSEnv, tmp_path: Path) -> None:
    arn = kms.create_key("pinned")
    store = _kms_ring(tmp_path, arn)
    codec = open_codec(store, audience=AUD, reload_every=0, kms_key_id=arn)
    token = codec.seal(b"in flight")
    swapped = swap_for_a_local_ring(store)
    forged = LocalAESGCMCodec.from_ring(swapped, audience=AUD).seal(b"forged")
    kms.proxy.reset()

    assert codec.reload() is False  # refused, not switched; nothing asked of KMS
    assert codec.reload_refused == (
        f"key ring {swapped.ring_id} generation 2 is a 'local' ring, but kms_key_id lets this process load only "
        "'kms' rings (was the keystore rewritten by someone who cannot use the expected keys?); still using "
        "generation 1"
    )
    assert codec.generation == 1 and kms.proxy.count == 0
    assert codec.unseal(token) == b"in flight"
    assert codec.unseal(codec.seal(b"next")) == b"next"
    with pytest.raises(InvalidRequestState):
        codec.unseal(forged)
    with pytest.raises(ConfigError, match="is a 'local' ring"):  # and a restart refuses it too
        open_codec(store, audience=AUD, reload_every=0, kms_key_id=arn)


def test_a_pinned_kms_codec_refuses_a_ring_wrapped_under_another_key_on_reload(kms: KMSEnv, tmp_path: Path) -> None:
    pinned, other = kms.create_key("pinned"), kms.create_key("other")
    store = _kms_ring(tmp_path, pinned)
    codec = open_codec(store, audience=AUD, reload_every=0, kms_key_id=pinned)
    loaded = store.load()
    theirs = _kms_ring(tmp_path, other, "theirs.json").load()
    store.save(replace(theirs, ring_id=loaded.ring_id, generation=2), expected_generation=1)
    kms.proxy.reset()
    assert codec.reload() is False
    assert codec.reload_refused is not None
    assert f"is wrapped under KMS key {other}, but kms_key_id lets this process load only rings wrapped under " in (
        codec.reload_refused
    )
    assert kms.proxy.count == 0  # refused before any Decrypt
    assert codec.unseal(codec.seal(b"still")) == b"still"
