"""Instances sharing a remote keystore and nothing else.

Three instances, each with its own working and state directory and no ring file anywhere, read one ring
from Vault KV v2 or Secrets Manager through a TCP proxy: two sidecars and a codec from
`mrtr_keys.request_state_security` (it keeps itself current with the ring watcher). Rounds cross instances
(sealed on one, unsealed on another) while the ring moves through begin and promote: 0 rejected rounds.
Then the proxy stops (the store is gone): all keep serving on the last good ring and their readiness says
the reload fails (the sidecars' /readyz, the codec's watcher); retire is written meanwhile; once the proxy
listens again all load it without a restart.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest

import mrtr_keys
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.keystores.aws_sm import SecretsManagerKeystore
from mrtr_keys.keystores.vault_kv import VaultKVKeystore
from mrtr_keys.providers.vault.client import VaultClient, VaultSettings
from tests.fixtures.keystores import REMOTE_KINDS
from tests.fixtures.moto_kms import AWS_ENV, REGION
from tests.fixtures.openbao import OpenBao
from tests.fixtures.sidecar import Sidecar, start_sidecar
from tests.support import tls
from tests.support.proxy import CountingProxy

pytestmark = pytest.mark.e2e

AUD = "billing"


@pytest.fixture(params=REMOTE_KINDS)
def shared_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """(URL, a direct keystore for the test's writes, a proxy the instances go through, their env)."""
    name = f"mrtr-fleet/{tmp_path.name}"
    if request.param == "vault-kv":
        bao: OpenBao = request.getfixturevalue("openbao")
        proxy = CountingProxy(int(bao.addr.rsplit(":", 1)[1]))
        direct: Any = VaultKVKeystore(
            "secret", name, client=VaultClient(VaultSettings(addr=bao.addr, token=bao.token)), state_dir=tmp_path / "w"
        )
        env = {"BAO_TOKEN": bao.token, "BAO_ADDR": proxy.url, "BAO_MAX_RETRIES": "0", "BAO_CLIENT_TIMEOUT": "2"}
    else:
        moto: str = request.getfixturevalue("moto_server")
        proxy = CountingProxy(int(moto.rsplit(":", 1)[1]))
        client = boto3.client(
            "secretsmanager", endpoint_url=moto, region_name=REGION, aws_access_key_id="t", aws_secret_access_key="x"
        )
        direct = SecretsManagerKeystore(name, client=client, state_dir=tmp_path / "w")
        env = {**AWS_ENV, "AWS_ENDPOINT_URL": proxy.url, "MRTR_KEYS_KMS_MAX_ATTEMPTS": "1"}
    with proxy:
        yield direct.url, direct, proxy, env


def test_three_instances_through_rotation_and_an_outage(
    shared_store: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, direct, proxy, env = shared_store
    create_ring(direct, audiences=(AUD,))
    instances: list[Sidecar] = []
    secrets_: list[str] = []
    try:
        for name in ("a", "b"):
            work = tmp_path / name
            s = start_sidecar(
                url,  # there is no ring file
                workdir=work,
                reload_interval=0.3,
                extra=["--clients", str(work / "clients.json")],
                env={**env, "MRTR_KEYS_STATE_DIR": str(work / "state")},
            )
            instances.append(s)
            secrets_.append(s.add_client("web", [AUD]))
        a, b = instances
        for name, value in {**env, "MRTR_KEYS_STATE_DIR": str(tmp_path / "c" / "state")}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.chdir(tmp_path / "a")
        library = mrtr_keys.request_state_security(url, audience=AUD, audit=False, reload_every=0.3).codec
        watcher = library.watcher  # type: ignore[attr-defined]
        codecs = [a.codec(AUD, secrets_[0]), b.codec(AUD, secrets_[1]), library]
        pids = [s.proc.pid for s in instances]
        rounds, rejected = [0], []
        stop = threading.Event()

        def traffic(i: int) -> None:
            sealer, opener = codecs[i], codecs[(i + 1) % 3]
            while not stop.is_set():
                payload = f"{i}-{rounds[0]}".encode()
                try:
                    if opener.unseal(sealer.seal(payload)) != payload:
                        rejected.append("mismatch")
                except Exception as exc:
                    rejected.append(f"{type(exc).__name__}: {exc}")
                rounds[0] += 1

        def wait_all(generation: int) -> None:
            for s, secret in zip(instances, secrets_, strict=True):
                s.wait_generation(secret, generation, timeout=30)
            deadline = time.monotonic() + 30
            while library.generation != generation:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, watcher.error
                time.sleep(0.05)

        threads = [threading.Thread(target=traffic, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        try:
            for step in ("begin", "promote"):
                wait_all(run_step(direct, step).ring.generation)
                time.sleep(0.3)
            promoted = direct.load().generation

            proxy.stop()  # the keystore is gone for the instances
            for s, secret in zip(instances, secrets_, strict=True):
                _wait_ready_doc(s, secret, lambda doc: doc["reload_error"] is not None)
            deadline = time.monotonic() + 30
            while watcher.error is None:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            retired = run_step(direct, "retire", force=True).ring.generation
            time.sleep(1.0)
            for s, secret in zip(instances, secrets_, strict=True):
                assert s.generation(secret) == promoted  # still serving the last good ring
            assert library.generation == promoted  # type: ignore[attr-defined]
            proxy.start()  # back: both pick up the retire by themselves
            wait_all(retired)
            for s, secret in zip(instances, secrets_, strict=True):
                _wait_ready_doc(s, secret, lambda doc: doc["reload_error"] is None and doc["ready"])
            assert watcher.error is None
            time.sleep(0.3)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        assert rejected == [] and rounds[0] > 50
        assert [s.proc.pid for s in instances] == pids and all(s.proc.poll() is None for s in instances)
        assert not any(p.name.endswith(".json") and "keyring" in p.name for p in tmp_path.rglob("*"))
        print(f"\n{url.split(':')[0]}: {rounds[0]} cross-instance rounds, {len(rejected)} rejected")
    finally:
        if "watcher" in locals():
            watcher.stop()
        for s in instances:
            s.stop()


def _wait_ready_doc(s: Sidecar, secret: str, check: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    doc: dict[str, Any] = {}
    with httpx.Client(base_url=s.url, timeout=10, verify=tls.CONTEXT) as http:
        while time.monotonic() < deadline:
            doc = http.get("/readyz").json()
            if check(doc):
                return
            time.sleep(0.1)
    raise AssertionError(f"readiness never matched: {doc}\n{s.output()[-3000:]}")
