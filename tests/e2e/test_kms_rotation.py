"""Rotation and rewrap of a KMS ring through the CLI, as a deploy pipeline runs them.

`init --codec kms` and `rotate begin` make data keys with GenerateDataKey; the three phases behave as
for the local codec (the MCP SDK's rotation: keys=[old,new] -> [new,old] -> [new]). `rewrap` moves
every data key to another KMS key with ReEncrypt, keeping kids, so tokens in flight stay valid.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rewrap import rewrap
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs.kms import KMSEnvelopeCodec
from mrtr_keys.errors import UnwrapError
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import CodecSpec
from tests.fixtures.common import run_cli
from tests.fixtures.moto_kms import KMSEnv

AUD = "provisioner"


def cli(kms: KMSEnv, path: Path, *args: str) -> dict[str, object]:
    result = run_cli(*args, "--json", keystore=path, env=kms.env)
    assert result.code == 0, result.err
    out: dict[str, object] = result.json()
    return out


def test_rotation_matrix_across_the_four_generations(kms: KMSEnv, tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    arn = kms.create_key()
    cli(kms, path, "init", "--codec", "kms", "--kms-key-id", arn, "--ttl", "1")
    codecs = [KMSEnvelopeCodec(path, audience=AUD)]  # generation 1: OLD seals
    for step in ("begin", "promote", "retire"):
        out = cli(kms, path, "rotate", step, *(["--force"] if step == "retire" else []))
        assert out["changed"] is True
        codecs.append(KMSEnvelopeCodec(path, audience=AUD))
    assert [c.generation for c in codecs] == [1, 2, 3, 4]
    ring = FileKeystore(path).load()
    assert ring.codec.params["kms_key_id"] == arn

    # Generation i seals with OLD (1, 2) or NEW (3, 4); generation j unseals OLD in 1-3 and NEW in 2-4.
    old_ok = {0, 1, 2}
    new_ok = {1, 2, 3}
    for i, sealer in enumerate(codecs):
        token = sealer.seal(f"gen{i + 1}".encode())
        accepted_by = old_ok if i < 2 else new_ok
        for j, opener in enumerate(codecs):
            if j in accepted_by:
                assert opener.unseal(token) == f"gen{i + 1}".encode(), (i + 1, j + 1)
            else:
                with pytest.raises(InvalidRequestState):
                    opener.unseal(token)


def test_rewrap_keeps_every_in_flight_token_valid_and_is_idempotent(kms: KMSEnv, tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    first, second = kms.create_key("first"), kms.create_key("second")
    create_ring(FileKeystore(path), codec=CodecSpec("kms", {"kms_key_id": first}))
    run_step(FileKeystore(path), "begin")
    run_step(FileKeystore(path), "promote")  # NEW seals, OLD verifies: both in flight
    running = KMSEnvelopeCodec(path, audience=AUD)  # an instance that keeps running across the rewrap
    in_flight = running.seal(b"sealed before the rewrap")
    before = FileKeystore(path).load()
    kms.proxy.reset()

    out = cli(kms, path, "rewrap", "--kms-key-id", second)
    assert out["changed"] is True and out["generation"] == before.generation + 1
    assert out["kms_key_id"] == second and out["from"] == first
    assert sorted(out["rewrapped"]) == sorted(k.kid for k in before.usable_keys())  # type: ignore[arg-type]
    assert kms.proxy.calls == {"DescribeKey": 1, "ReEncrypt": 2}

    after = FileKeystore(path).load()
    assert [k.kid for k in after.keys] == [k.kid for k in before.keys]
    assert after.codec.params["kms_key_id"] == second
    assert {k.key_data["kms_key_arn"] for k in after.usable_keys()} == {second}
    # Tokens in flight: sealed before the rewrap, unsealed by a fresh codec (unwraps under the new key)...
    fresh = KMSEnvelopeCodec(path, audience=AUD)
    assert fresh.unseal(in_flight) == b"sealed before the rewrap"
    assert fresh.unseal(running.seal(b"from the running instance")) == b"from the running instance"
    # ...and by a running instance after it reloads.
    assert running.reload() is True
    assert running.unseal(fresh.seal(b"y")) == b"y"

    # Idempotent: same target again, by ARN or key id, changes nothing and re-encrypts nothing.
    kms.proxy.reset()
    again = cli(kms, path, "rewrap", "--kms-key-id", second.rsplit("/", 1)[-1])
    assert again["changed"] is False and again["generation"] == after.generation
    assert kms.proxy.calls == {"DescribeKey": 1}
    assert "nothing to do" in str(again["message"])
    # A process pinned to the old key refuses the rewrapped ring.
    with pytest.raises(UnwrapError, match="KeyIdMismatch"):
        KMSEnvelopeCodec(path, audience=AUD, kms_key_id=first)


def test_rewrap_keeps_a_token_sealed_by_the_old_primary_valid(kms: KMSEnv, tmp_path: Path) -> None:
    # Mid-rotation (phase 2) both keys are in flight; after rewrap both still open.
    path = tmp_path / "keyring.json"
    create_ring(FileKeystore(path), codec=CodecSpec("kms", {"kms_key_id": kms.create_key()}))
    run_step(FileKeystore(path), "begin")
    by_old = KMSEnvelopeCodec(path, audience=AUD).seal(b"sealed by OLD")
    run_step(FileKeystore(path), "promote")
    by_new = KMSEnvelopeCodec(path, audience=AUD).seal(b"sealed by NEW")
    assert rewrap(FileKeystore(path), kms.create_key("target")).changed
    codec = KMSEnvelopeCodec(path, audience=AUD)
    assert codec.unseal(by_old) == b"sealed by OLD"
    assert codec.unseal(by_new) == b"sealed by NEW"


def test_rewrap_on_a_local_ring_is_a_usage_error(kms: KMSEnv, tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    assert run_cli("init", keystore=path).code == 0
    result = run_cli("rewrap", "--kms-key-id", kms.create_key(), keystore=path, env=kms.env)
    assert result.code == 2
    assert "rewrap applies to kms key rings" in result.err


def test_init_with_an_unknown_kms_key_is_a_usage_error(kms: KMSEnv, tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    bogus = "arn:aws:kms:us-east-1:123456789012:key/00000000-0000-0000-0000-000000000000"
    result = run_cli("init", "--codec", "kms", "--kms-key-id", bogus, keystore=path, env=kms.env)
    assert result.code == 2, result.err
    assert "KMS DescribeKey failed" in result.err and "NotFoundException" in result.err
    assert not path.exists()


def test_inspect_describes_and_decrypts_a_kms_token(kms: KMSEnv, tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    create_ring(FileKeystore(path), codec=CodecSpec("kms", {"kms_key_id": kms.create_key()}))
    codec = KMSEnvelopeCodec(path, audience=AUD)
    token = codec.seal(b'{"v":1,"s":"inner"}')
    info = cli(kms, path, "inspect", token)
    assert (info["format"], info["kid"], info["state"]) == ("mk2", codec.ring.primary.kid, "primary")
    decrypted = cli(kms, path, "inspect", token, "--decrypt", "--audience", AUD)
    assert decrypted["decrypted"] is True and decrypted["envelope_version"] == 1


@pytest.mark.parametrize("usage", [None, "ENCRYPT_DECRYPT", "SIGN_VERIFY"])
def test_init_and_rewrap_judge_a_kms_key_the_same_way(kms: KMSEnv, tmp_path: Path, usage: str | None) -> None:
    """One check for both (our decision; AWS KMS API reference, CreateKey): a key created without KeyUsage,
    whose DescribeKey answer omits it (moto does), is a symmetric encryption key by default, so both accept
    it; a signing key is refused by both with the same message, and nothing is written."""
    spec = {} if usage is None else {"KeyUsage": usage, "KeySpec": "RSA_2048" if usage == "SIGN_VERIFY" else None}
    made = kms.admin.create_key(Description=f"usage {usage}", **{k: v for k, v in spec.items() if v})
    target = made["KeyMetadata"]["Arn"]
    assert ("KeyUsage" in kms.admin.describe_key(KeyId=target)["KeyMetadata"]) is (usage is not None)
    fresh, existing = tmp_path / "fresh.json", tmp_path / "existing.json"
    create_ring(FileKeystore(existing), codec=CodecSpec("kms", {"kms_key_id": kms.create_key()}))
    init = run_cli("init", "--codec", "kms", "--kms-key-id", target, keystore=fresh, env=kms.env)
    moved = run_cli("rewrap", "--kms-key-id", target, keystore=existing, env=kms.env)
    if usage == "SIGN_VERIFY":
        refusal = f"KMS key {target} is not a symmetric encryption key (SYMMETRIC_DEFAULT, ENCRYPT_DECRYPT)"
        assert (init.code, moved.code) == (2, 2)
        assert refusal in init.err and refusal in moved.err
        assert not fresh.exists() and FileKeystore(existing).load().generation == 1
        return
    assert (init.code, moved.code) == (0, 0), (init.err, moved.err)
    assert FileKeystore(fresh).load().codec.params["kms_key_id"] == target
    assert FileKeystore(existing).load().codec.params["kms_key_id"] == target
