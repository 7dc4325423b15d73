"""The Kubernetes manifests: schema-valid (kubernetes-validate, offline, strict), and the rotation
CronJob's container run as written (issue 16, deliverable 1; docs/deploy.md).

The CronJob's container runs with the image's ENTRYPOINT and the manifest's args, the image's ENV then
the manifest's env (secretKeyRef values supplied as the Secrets would: the OpenBao token, the PostgreSQL
URL), as uid 10001 with only the emptyDir state volume writable, against a dedicated OpenBao dev server
(KV v2 at secret/) and a throwaway PostgreSQL database. Three runs: a no-op while the primary is young,
then (primary aged 31 days) phase 1, then phase 2.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from tests.deploy.sandbox import REPO, Sandbox, read_image

pytestmark = pytest.mark.e2e
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
CRONJOB = REPO / "deploy" / "kubernetes" / "rotation-cronjob.yaml"


def test_manifests_validate_offline() -> None:
    tool = REPO / ".venv" / "bin" / "kubernetes-validate"
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_proxy", "_PROXY"))}
    env.update({"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"})  # no network needed
    assert len(MANIFESTS) >= 2
    done = subprocess.run([str(tool), "--strict", *map(str, MANIFESTS)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    for path in MANIFESTS:
        assert f"{path} passed" in done.stdout, done.stdout


def _container() -> tuple[dict[str, object], dict[str, object]]:
    doc = yaml.safe_load(CRONJOB.read_text())
    assert doc["kind"] == "CronJob"
    pod = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def test_rotation_cronjob_runs_as_written(box: Sandbox, postgres_url: str) -> None:
    from tests.fixtures.openbao import _bao_dev_server

    pod, container = _container()
    assert pod["securityContext"]["runAsUser"] == 10001 and container["securityContext"]["readOnlyRootFilesystem"]
    image = read_image()
    args = [str(a) for a in container["args"]]
    assert args[:2] == ["rotate", "next"] and "--wait" in args
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    with _bao_dev_server() as bao:
        secrets = {("mrtr-keys-deploy-role", "vault-token"): bao.token, ("mrtr-keys-audit", "url"): postgres_url}
        env = dict(image.env)
        for item in container["env"]:
            if "value" in item:
                env[item["name"]] = str(item["value"])
            else:
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = secrets[(ref["name"], ref["key"])]
        assert env["VAULT_ADDR"].startswith("https://vault.internal")
        env["VAULT_ADDR"] = bao.addr  # the cluster's Vault is this dev server
        box.make_dir(mounts["state"], writable=True)
        keystore_url = env["MRTR_KEYS_KEYSTORE"]

        # The deploy role created the ring once (as in docs/keystores.md).
        admin = {**os.environ, "VAULT_ADDR": bao.addr, "VAULT_TOKEN": bao.token, "MRTR_KEYS_AUDIT": postgres_url}
        admin["MRTR_KEYS_STATE_DIR"] = str(box.root / "admin-state")
        init = subprocess.run(
            [str(REPO / ".venv" / "bin" / "mrtr-keys"), "init", "--keystore", keystore_url],
            env=admin,
            capture_output=True,
            text=True,
        )
        assert init.returncode == 0, init.stderr

        def run_job() -> subprocess.CompletedProcess[str]:
            return box.run([*image.entrypoint, *args], env, cwd=image.workdir, timeout=300)

        young = run_job()
        assert young.returncode == 0, young.stdout + young.stderr
        assert young.stdout.startswith("nothing to do: primary ") and "younger than 30d" in young.stdout

        _age_primary(keystore_url, admin, days=31)
        begun = run_job()
        assert begun.returncode == 0, begun.stdout + begun.stderr
        assert "phase 1:" in begun.stdout
        promoted = run_job()
        assert promoted.returncode == 0, promoted.stdout + promoted.stderr
        assert "phase 2:" in promoted.stdout
        assert Path(box.path(mounts["state"])).is_dir()


def _age_primary(url: str, env: dict[str, str], *, days: int) -> None:
    """Rewrite the stored ring as if its primary had been promoted `days` ago (a test-only edit)."""
    saved = {k: os.environ.get(k) for k in ("VAULT_ADDR", "VAULT_TOKEN")}
    os.environ.update({"VAULT_ADDR": env["VAULT_ADDR"], "VAULT_TOKEN": env["VAULT_TOKEN"]})
    try:
        from mrtr_keys.keystores import open_keystore
        from mrtr_keys.ring.model import utcnow

        store = open_keystore(url)
        ring = store.load()
        old = utcnow() - timedelta(days=days)
        keys = tuple(replace(k, created_at=old, promoted_at=old) if k.kid == ring.primary.kid else k for k in ring.keys)
        store.save(ring.next_generation(keys=keys), expected_generation=ring.generation)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
