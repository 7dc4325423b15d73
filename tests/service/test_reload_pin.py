"""The codec pin holds against a swapped ring in the sidecar (issue 39, item 9).

The sidecar opens whatever codec the stored ring records, at start and on every reload, so before the pin
someone who can write the keystore but cannot use its KMS key could replace a KMS ring by a ``local`` ring
of keys they chose and have a running sidecar seal and unseal with them within one reload interval. With a
pin (``MRTR_KEYS_KMS_KEY_ID``, ``--expect-codec`` / ``MRTR_KEYS_EXPECT_CODEC`` / ``expect_codec`` in the
config file) such a ring is refused: at start in one line, exit 2; on reload like an older generation (the
last good ring keeps serving and ``/readyz``, ``/v1/keys`` and ``/metrics`` say so). Library codecs:
tests/codecs/test_pin.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.changes.create import create_ring
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import CodecSpec
from tests.fixtures.common import run_cli
from tests.fixtures.keyrings import swap_for_a_local_ring
from tests.fixtures.moto_kms import KMSEnv
from tests.support.waiting import until

pytestmark = pytest.mark.e2e  # the CLI and sidecars in their own processes

ARN = "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"
AUD = "svc"


@pytest.mark.parametrize(
    ("args", "env", "config", "source"),
    [
        ([], {"MRTR_KEYS_KMS_KEY_ID": ARN}, "", "MRTR_KEYS_KMS_KEY_ID"),
        (["--expect-codec", "kms"], {}, "", "expect_codec"),
        ([], {"MRTR_KEYS_EXPECT_CODEC": "kms"}, "", "expect_codec"),
        ([], {}, 'expect_codec = "kms"', "expect_codec"),
    ],
    ids=["kms-key-env", "flag", "env", "config-file"],
)
def test_a_pinned_sidecar_refuses_a_local_ring_at_start_in_one_line(
    keystore_path: Path, tmp_path: Path, args: list[str], env: dict[str, str], config: str, source: str
) -> None:
    cfg = tmp_path / "sidecar.toml"
    cfg.write_text(f"[sidecar]\n{config}\n")
    sock = str(tmp_path / "s.sock")
    env = {"MRTR_KEYS_KMS_KEY_ID": "", "MRTR_KEYS_EXPECT_CODEC": "", **env}
    r = run_cli("serve", "--uds", sock, "--config", str(cfg), *args, keystore=keystore_path, env=env, timeout=30)
    ring = FileKeystore(keystore_path).load()
    assert r.code == 2, (r.out, r.err)
    assert r.err == (
        f"mrtr-keys: refused: key ring {ring.ring_id} generation 1 is a 'local' ring, but {source} lets this "
        "process load only 'kms' rings (was the keystore rewritten by someone who cannot use the expected keys?)\n"
    )
    assert not (keystore_path.parent / "audit.db").exists()  # refused before the audit log was opened


def test_an_expect_codec_that_is_no_codec_is_refused(keystore_path: Path, tmp_path: Path) -> None:
    r = run_cli("serve", "--uds", str(tmp_path / "s.sock"), "--expect-codec", "aes", keystore=keystore_path)
    assert (r.code, r.err) == (2, "mrtr-keys: expect_codec must be one of kms, local, vault-transit\n")


def test_a_pinned_sidecar_keeps_serving_its_kms_ring_when_it_is_swapped_for_a_local_one(
    kms: KMSEnv, tmp_path: Path, sidecar_factory: Any
) -> None:
    arn = kms.create_key("pinned")
    store = FileKeystore(tmp_path / "ring.json")
    create_ring(store, codec=CodecSpec("kms", {"kms_key_id": arn}))
    sidecar = sidecar_factory(store.path, env={**kms.env, "MRTR_KEYS_KMS_KEY_ID": arn})
    secret = sidecar.add_client("app", [AUD])
    codec, http = sidecar.codec(AUD, secret), sidecar.http(secret)
    token = codec.seal(b"in flight")

    swapped = swap_for_a_local_ring(store)
    forged = LocalAESGCMCodec.from_ring(swapped, audience=AUD).seal(b"forged")
    refusal = (
        f"key ring {swapped.ring_id} generation 2 is a 'local' ring, but MRTR_KEYS_KMS_KEY_ID lets this process "
        "load only 'kms' rings (was the keystore rewritten by someone who cannot use the expected keys?); still "
        "using generation 1"
    )
    until(lambda: http.get("/readyz").json()["reload_error"] == refusal, 15, "the refusal in /readyz")
    assert http.get("/v1/keys").json()["generation"] == 1
    assert http.get("/readyz?strict=true").status_code == 503  # strict readiness counts a refused ring
    assert "mrtr_sidecar_ring_stale 1.0" in http.get("/metrics").text
    assert codec.unseal(token) == b"in flight"
    assert codec.unseal(codec.seal(b"next")) == b"next"
    answer = http.post("/v1/unseal", json={"audience": AUD, "token": forged})
    assert answer.status_code == 400
    time.sleep(0.3)  # a few more reload checks: still refused, logged once
    assert sidecar.output().count("key ring not reloaded: " + refusal) == 1
