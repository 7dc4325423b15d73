"""docs/keystores.md as written: its command blocks run against the OpenBao dev server and moto,
and its least-privilege policies do what the page says: the instance policy reads and refuses writes with
one line naming the keystore and the permission, the deploy policy writes. AppRole and a Kubernetes
service-account login (``VAULT_K8S_ROLE``) log in the same way."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.errors import KeystoreError
from mrtr_keys.keystores.aws_sm import SecretsManagerKeystore
from mrtr_keys.keystores.vault_kv import VaultKVKeystore
from mrtr_keys.providers.vault.client import VaultClient, VaultSettings
from tests.fixtures.common import REPO, run_cli
from tests.fixtures.k8s_login import ServiceAccountIssuer
from tests.fixtures.moto_kms import AWS_ENV, REGION, KMSEnv
from tests.fixtures.openbao import OpenBao
from tests.support.services import start_moto

pytestmark = pytest.mark.e2e

DOC = (REPO / "docs" / "keystores.md").read_text()
BIN = str(Path(sys.executable).parent)


def blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC, re.S)


def test_every_command_block_runs(openbao: OpenBao, kms: KMSEnv, tmp_path: Path) -> None:
    env = {
        **os.environ,
        **kms.env,
        **openbao.env(),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "MRTR_KEYS_STATE_DIR": str(tmp_path / "state"),
    }
    env.pop("VAULT_ADDR", None)
    env.pop("VAULT_TOKEN", None)
    assert len(blocks("sh")) == 4
    for block in blocks("sh"):
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, (block, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr


def _policy_token(bao: OpenBao, name: str, hcl: str) -> str:
    bao.api("PUT", f"sys/policies/acl/{name}", {"policy": hcl})
    auth = bao.api("POST", "auth/token/create", {"policies": [name], "no_default_policy": True})["auth"]
    return str(auth["client_token"])  # type: ignore[index]


def test_the_vault_policies_read_and_write_as_documented(openbao: OpenBao, tmp_path: Path) -> None:
    read_hcl, write_hcl = (b.replace("mrtr/keyring", "mrtr/policy-test") for b in blocks("hcl"))
    suffix = secrets.token_hex(3)
    reader = _policy_token(openbao, f"mrtr-read-{suffix}", read_hcl)
    writer = _policy_token(openbao, f"mrtr-write-{suffix}", write_hcl)
    url = "vault-kv://secret/mrtr/policy-test"

    def store(token: str) -> VaultKVKeystore:
        client = VaultClient(VaultSettings(addr=openbao.addr, token=token))
        return VaultKVKeystore("secret", "mrtr/policy-test", client=client, state_dir=tmp_path / "state")

    env = {"BAO_ADDR": openbao.addr, "MRTR_KEYS_STATE_DIR": str(tmp_path / "state")}
    r = run_cli("init", keystore=url, env={**env, "BAO_TOKEN": writer})
    assert r.code == 0, r.err
    assert store(reader).load().generation == 1 and store(reader).revision() == "1"
    r = run_cli("rotate", "begin", keystore=url, env={**env, "BAO_TOKEN": reader})
    assert r.code == 1
    assert r.err == (
        f"mrtr-keys: key ring {url}: permission denied: Vault refused to write secret/data/mrtr/policy-test "
        "(HTTP 403); the token's policy needs 'create and update' on 'secret/data/mrtr/policy-test' "
        "(docs/keystores.md)\n"
    )
    assert run_step(store(writer), "begin").ring.generation == 2
    with pytest.raises(KeystoreError, match="permission denied: Vault refused to read secret/data/mrtr/other"):
        VaultKVKeystore("secret", "mrtr/other", client=store(reader).client).load()

    # AppRole with the instance policy: the same client code logs in and reads.
    mount = f"approle-{suffix}"
    openbao.api("POST", f"sys/auth/{mount}", {"type": "approle"})
    openbao.api("POST", f"auth/{mount}/role/instances", {"token_policies": [f"mrtr-read-{suffix}"]})
    role_id = openbao.api("GET", f"auth/{mount}/role/instances/role-id")["data"]["role_id"]  # type: ignore[index]
    secret_id = openbao.api("POST", f"auth/{mount}/role/instances/secret-id")["data"]["secret_id"]  # type: ignore[index]
    settings = VaultSettings(addr=openbao.addr, role_id=role_id, secret_id=secret_id, approle_mount=mount)
    approle = VaultKVKeystore("secret", "mrtr/policy-test", client=VaultClient(settings))
    assert approle.load().generation == 2

    # A pod's service-account JWT (VAULT_K8S_ROLE), the instance policy: reads, refuses to write, and a
    # token of another service account or none at all is refused in one line (tests/fixtures/k8s_login.py).
    issuer, mount = ServiceAccountIssuer(), f"k8s-{suffix}"
    issuer.configure(openbao, mount)
    policies = [f"mrtr-read-{suffix}"]
    issuer.role(openbao, mount, "sidecar", namespace="mcp", account="mcp-billing", audience="vault", policies=policies)
    jwt = tmp_path / "sa-token"
    jwt.write_text(issuer.token("mcp", "mcp-billing", audience="vault"))
    pod = {
        "BAO_ADDR": openbao.addr,
        "VAULT_K8S_ROLE": "sidecar",
        "VAULT_K8S_MOUNT": mount,
        "VAULT_K8S_TOKEN_FILE": str(jwt),
    }
    pod_client = VaultClient(VaultSettings.from_env(pod))
    assert VaultKVKeystore("secret", "mrtr/policy-test", client=pod_client).load().generation == 2
    r = run_cli("keys", "list", keystore=url, env={**env, **pod})
    assert r.code == 0, r.err
    with pytest.raises(KeystoreError, match="permission denied: Vault refused to write secret/data/mrtr/policy-test"):
        run_step(VaultKVKeystore("secret", "mrtr/policy-test", client=pod_client), "promote", force=True)
    jwt.write_text(issuer.token("mcp", "someone-else", audience="vault"))
    r = run_cli("keys", "list", keystore=url, env={**env, **pod})
    assert r.code == 1 and r.err.startswith(
        f"mrtr-keys: key ring {url}: Vault refused the Kubernetes login (role 'sidecar', POST auth/{mount}/login): "
        "HTTP 400: "
    ), r.err
    assert len(r.err.splitlines()) == 1
    assert "Traceback" not in r.err and jwt.read_text() not in r.err
    jwt.unlink()
    r = run_cli("keys", "list", keystore=url, env={**env, **pod})
    assert r.code != 0 and r.err == (
        f"mrtr-keys: cannot read the service-account token for the Vault Kubernetes login at {jwt} "
        "(No such file or directory); set VAULT_K8S_TOKEN_FILE or mount the token\n"
    )


@pytest.fixture
def moto_with_iam(tmp_path: Path) -> Iterator[str]:
    """A moto server that enforces IAM after its first 6 actions (the set-up below makes exactly 6)."""
    server = start_moto(tmp_path / "moto-iam", env={**AWS_ENV, "INITIAL_NO_AUTH_ACTION_COUNT": "6"})
    try:
        yield server.url
    finally:
        server.stop()


def test_the_iam_actions_read_and_write_as_documented(moto_with_iam: str, tmp_path: Path) -> None:
    """moto checks actions, not resources (it authorises Secrets Manager calls against ``*``), so the
    documented Resource is widened to ``*`` here; the action lists are the page's."""
    iam = boto3.client(
        "iam", endpoint_url=moto_with_iam, region_name=REGION, aws_access_key_id="a", aws_secret_access_key="b"
    )
    keys: dict[str, dict[str, str]] = {}
    for role, policy in zip(("reader", "writer"), blocks("json"), strict=True):
        doc = json.loads(policy)
        for statement in doc["Statement"]:
            statement["Resource"] = "*"
        iam.create_user(UserName=role)
        iam.put_user_policy(UserName=role, PolicyName="mrtr-keys", PolicyDocument=json.dumps(doc))
        key = iam.create_access_key(UserName=role)["AccessKey"]
        keys[role] = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}

    def store(role: str) -> SecretsManagerKeystore:
        client = boto3.client(
            "secretsmanager",
            endpoint_url=moto_with_iam,
            region_name=REGION,
            aws_access_key_id=keys[role]["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=keys[role]["AWS_SECRET_ACCESS_KEY"],
        )
        return SecretsManagerKeystore("mrtr/keyring", client=client, state_dir=tmp_path / role)

    create_ring(store("writer"))
    assert store("reader").load().generation == 1 and store("reader").revision() is not None
    env = {**AWS_ENV, **keys["reader"], "AWS_ENDPOINT_URL": moto_with_iam, "MRTR_KEYS_STATE_DIR": str(tmp_path / "s")}
    r = run_cli("rotate", "begin", keystore="aws-sm://mrtr/keyring", env=env)
    assert r.code == 1 and len(r.err.splitlines()) == 1 and "Traceback" not in r.err
    assert r.err.startswith(
        "mrtr-keys: key ring aws-sm://mrtr/keyring: permission denied: secretsmanager:PutSecretValue ("
    )
    assert run_step(store("writer"), "begin").ring.generation == 2
    assert store("reader").load().generation == 2
