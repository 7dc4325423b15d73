"""The Kubernetes manifests: schema-valid (kubernetes-validate, offline, strict), and one fleet run as written
(issue 16, deliverable 1; issue 23, deliverable 4; docs/deploy.md).

Each container runs with the image's ENTRYPOINT (or the manifest's command) and the manifest's args, the
image's ENV then the manifest's env (secretKeyRef values supplied as the Secrets would: the PostgreSQL URL;
fieldRef metadata.name as the pod's name), as uid 10001 with only its emptyDir volumes writable, the Secret
and projected service-account token volumes read-only (0440, group 10001), against one OpenBao dev server
for the module (KV v2 at secret/) and a throwaway PostgreSQL database.

The Vault side is what docs/deploy.md tells a platform team to set up, read from the manifests: one login
role per workload (role name from VAULT_K8S_ROLE, bound to the manifest's namespace and service account and
to the projected token's audience) with the policies of docs/keystores.md (the sidecars read, the CronJob
writes). The login is served by OpenBao's jwt auth method mounted at auth/kubernetes, trusting a test
cluster's signing key (tests/fixtures/k8s_login.py): the kubernetes auth method would call a Kubernetes
API (TokenReview) that a test machine does not have, and both take the same login.

What the test changes, and nothing else: the Vault address (https://vault.internal:8200 becomes the
dev server, for the second pod a proxy in front of it, which stands for that pod's network), and the ring,
created by the admin with a 5 s TTL and its key times moved back (test-only edits, as if 30 days and the
retire wait had passed), so a full rotation takes seconds, not 30 days and TTL + 60 s. The manifests'
intervals (reload 2 s, heartbeat 10 s, --wait 900) are used as written.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.sandbox import GID, REPO, Sandbox, read_image
from tests.fixtures.k8s_login import ServiceAccountIssuer
from tests.fixtures.openbao import OpenBao, _bao_dev_server
from tests.support.proxy import CountingProxy

pytestmark = pytest.mark.e2e
KUBE = REPO / "deploy" / "kubernetes"
MANIFESTS = sorted(KUBE.glob("*.yaml"))
CRONJOB, SIDECAR = KUBE / "rotation-cronjob.yaml", KUBE / "sidecar.yaml"
VAULT_IN_MANIFESTS = "https://vault.internal:8200"
LOGIN_MOUNT = "kubernetes"  # VAULT_K8S_MOUNT's default; the manifests do not set it
TTL = 5.0
BOUND = 60.0


def test_manifests_validate_offline() -> None:
    tool = REPO / ".venv" / "bin" / "kubernetes-validate"
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_proxy", "_PROXY"))}
    env.update({"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"})  # no network needed
    assert len(MANIFESTS) >= 3
    done = subprocess.run([str(tool), "--strict", *map(str, MANIFESTS)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    for path in MANIFESTS:
        assert f"{path} passed" in done.stdout, done.stdout


def test_every_manifest_is_one_fleet() -> None:
    """Every file under deploy/kubernetes/ describes the same fleet by default (issue 39, item 7): one namespace,
    one image, and every mrtr-keys container on the one presence/audit store (the Secret mrtr-keys-audit) with the
    fleet's one audit key (the Secret mrtr-keys-audit-key, mounted read-only 0440), logging JSON; the sidecars
    name themselves after their pods. A variant that left the store out would hold sidecars that
    `rotate next --wait` never waits for."""
    images = set()
    for path in MANIFESTS:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert {d["metadata"].get("namespace") for d in docs} == {"mcp"}, path.name
        workloads = [d for d in docs if d["kind"] in ("Deployment", "CronJob")]
        assert workloads, path.name
        for doc in workloads:
            spec = doc["spec"]
            pod = (spec["jobTemplate"]["spec"] if doc["kind"] == "CronJob" else spec)["template"]["spec"]
            (container,) = [c for c in pod["containers"] if "/mrtr-keys:" in c["image"]]
            images.add(container["image"])
            env = {e["name"]: e for e in container["env"]}
            where = f"{path.name}: {container['name']}"
            assert env["MRTR_KEYS_AUDIT"]["valueFrom"]["secretKeyRef"] == {"name": "mrtr-keys-audit", "key": "url"}
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            key_dir, _, key_name = env["MRTR_KEYS_AUDIT_KEY_FILE"]["value"].rpartition("/")
            volume = next(v for v in pod["volumes"] if v["name"] == mounts[key_dir]["name"])
            assert key_name == "audit.key" and mounts[key_dir]["readOnly"], where
            assert volume["secret"] == {"secretName": "mrtr-keys-audit-key", "defaultMode": 0o440}, where
            assert env["MRTR_KEYS_LOG_FORMAT"]["value"] == "json", where
            assert pod["securityContext"]["runAsUser"] == 10001 and pod["automountServiceAccountToken"] is False
            if doc["kind"] == "Deployment":
                assert env["MRTR_KEYS_INSTANCE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, where
                # anchored by default where the database cannot reach: an object-locked bucket (issue 38)
                assert env["MRTR_KEYS_AUDIT_ANCHOR"]["value"] == "s3://mrtr-keys-audit-anchors/mcp-billing", where
    assert len(images) == 1, images


@dataclass
class Workload:
    """One manifest's mrtr-keys container, with its pod and where it runs."""

    namespace: str
    account: str
    pod: dict[str, Any]
    container: dict[str, Any]

    @classmethod
    def read(cls, path: Path, kind: str) -> Workload:
        doc = next(d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == kind)
        template = doc["spec"]["jobTemplate"]["spec"]["template"] if kind == "CronJob" else doc["spec"]["template"]
        pod = template["spec"]
        (container,) = [c for c in pod["containers"] if "/mrtr-keys:" in c["image"]]
        return cls(doc["metadata"]["namespace"], pod["serviceAccountName"], pod, container)

    def value(self, name: str) -> str:
        return str(next(e["value"] for e in self.container["env"] if e["name"] == name))

    def mounts(self) -> dict[str, str]:
        return {m["name"]: m["mountPath"] for m in self.container["volumeMounts"]}

    def token_audience(self) -> str:
        (volume,) = [v for v in self.pod["volumes"] if "projected" in v]
        (source,) = volume["projected"]["sources"]
        return str(source["serviceAccountToken"]["audience"])

    def argv(self, image: Any) -> list[str]:
        head = self.container.get("command") or image.entrypoint
        return [str(a) for a in [*head, *self.container.get("args", [])]]

    def lay_out(
        self,
        box: Sandbox,
        image: Any,
        *,
        pod_name: str,
        secrets: dict[tuple[str, str], str],
        token: str,
        files: dict[str, bytes],
    ) -> dict[str, str]:
        """Create the pod's volumes in `box` as the kubelet would and return the container's environment."""
        mounts = self.mounts()
        for volume in self.pod["volumes"]:
            where = mounts.get(volume["name"])
            if where is None:
                continue
            if "emptyDir" in volume:
                box.make_dir(where, writable=True)
                continue
            box.make_dir(where, writable=False)
            if "projected" in volume:
                (source,) = volume["projected"]["sources"]
                contents = {source["serviceAccountToken"]["path"]: token.encode()}
            else:
                name = volume["secret"]["secretName"]
                contents = {
                    key: files[f"{name}/{key}"]
                    for key in [k.split("/", 1)[1] for k in files if k.startswith(name + "/")]
                }
            for key, data in contents.items():
                target = box.path(where) / key
                target.write_bytes(data)
                os.chown(target, 0, GID)  # root:fsGroup, 0440: as the kubelet writes a Secret or a token
                target.chmod(0o440)
        env = dict(image.env)
        for item in self.container["env"]:
            if "value" in item:
                env[item["name"]] = str(item["value"])
            elif "secretKeyRef" in item["valueFrom"]:
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = secrets[(ref["name"], ref["key"])]
            else:
                assert item["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
                env[item["name"]] = pod_name
        return env


SIDECAR_POD = Workload.read(SIDECAR, "Deployment")
ROTATION = Workload.read(CRONJOB, "CronJob")


def _policies() -> tuple[str, str]:
    """The instance and deploy-role policies of docs/keystores.md, as written."""
    read, write = re.findall(r"```hcl\n(.*?)```", (REPO / "docs" / "keystores.md").read_text(), re.S)[:2]
    return read, write


@dataclass
class Cluster:
    bao: OpenBao
    issuer: ServiceAccountIssuer

    def token(self, workload: Workload) -> str:
        return self.issuer.token(workload.namespace, workload.account, audience=workload.token_audience())


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """One OpenBao for the module, with the login roles and policies docs/deploy.md describes."""
    with _bao_dev_server() as bao:
        issuer = ServiceAccountIssuer()
        issuer.configure(bao, LOGIN_MOUNT)
        roles = zip((SIDECAR_POD, ROTATION), ("mrtr-keys-read", "mrtr-keys-write"), _policies(), strict=True)
        for workload, policy, hcl in roles:
            assert not any(e["name"] == "VAULT_K8S_MOUNT" for e in workload.container["env"])
            bao.api("PUT", f"sys/policies/acl/{policy}", {"policy": hcl})
            issuer.role(
                bao,
                LOGIN_MOUNT,
                workload.value("VAULT_K8S_ROLE"),
                namespace=workload.namespace,
                account=workload.account,
                audience=workload.token_audience(),
                policies=[policy],
            )
        yield Cluster(bao, issuer)


@dataclass
class Admin:
    """The platform team's shell: root token, the shared audit store and audit key, its own state directory."""

    env: dict[str, str]
    audit_key: bytes

    def secret_files(self) -> dict[str, bytes]:
        """The Secret mrtr-keys-audit-key as the manifests mount it (created once, as sidecar.yaml says)."""
        return {"mrtr-keys-audit-key/audit.key": self.audit_key}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(REPO / ".venv" / "bin" / "mrtr-keys"), *args], env=self.env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done


@pytest.fixture
def admin(cluster: Cluster, postgres_url: str, tmp_path: Path) -> Admin:
    """A fresh ring (TTL 5 s) in vault-kv://secret/mrtr/keyring, created as docs/keystores.md shows."""
    bao = cluster.bao
    bao.api("DELETE", "secret/metadata/mrtr/keyring")  # each test starts without a ring
    env = {**os.environ, "VAULT_ADDR": bao.addr, "VAULT_TOKEN": bao.token, "MRTR_KEYS_AUDIT": postgres_url}
    key_file = tmp_path / "audit.key"  # head -c 32 /dev/urandom > audit.key, kept by the admin at mode 0600
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    env.update(
        {
            "MRTR_KEYS_STATE_DIR": str(tmp_path / "admin-state"),
            "MRTR_KEYS_KEYSTORE": ROTATION.value("MRTR_KEYS_KEYSTORE"),
            "MRTR_KEYS_AUDIT_KEY_FILE": str(key_file),
        }
    )
    admin = Admin(env, key_file.read_bytes())
    admin.run("init", "--audience", "billing", "--ttl", f"{TTL:g}")
    return admin


def test_rotation_cronjob_runs_as_written(box: Sandbox, cluster: Cluster, admin: Admin, postgres_url: str) -> None:
    image = read_image()
    assert ROTATION.pod["securityContext"]["runAsUser"] == 10001
    assert ROTATION.container["securityContext"]["readOnlyRootFilesystem"]
    args = ROTATION.argv(image)
    assert args[1:4] == ["rotate", "next", "--if-older-than"] and "--wait" in args
    assert args[args.index("--if-used-over") + 1] == "0.5"  # by use too (issue 36): whichever comes first
    env = ROTATION.lay_out(
        box,
        image,
        pod_name="rotation-1",
        secrets={("mrtr-keys-audit", "url"): postgres_url},
        token=cluster.token(ROTATION),
        files=admin.secret_files(),
    )
    assert env["VAULT_ADDR"] == VAULT_IN_MANIFESTS and "VAULT_TOKEN" not in env
    env["VAULT_ADDR"] = cluster.bao.addr  # the cluster's Vault is this dev server

    def run_job() -> subprocess.CompletedProcess[str]:
        return box.run(args, env, cwd=image.workdir, timeout=300)  # type: ignore[no-any-return]

    young = run_job()
    assert young.returncode == 0, young.stdout + young.stderr
    assert young.stdout.startswith("nothing to do: primary ") and "younger than 30d" in young.stdout
    assert "of its seal budget of 140,737,488,355,328 (" in young.stdout and "), not over 50 %" in young.stdout

    _backdate(admin, days=31)
    begun = run_job()
    assert begun.returncode == 0, begun.stdout + begun.stderr
    assert "phase 1:" in begun.stdout
    promoted = run_job()
    assert promoted.returncode == 0, promoted.stdout + promoted.stderr
    assert "phase 2:" in promoted.stdout
    assert box.path(ROTATION.mounts()["state"]).is_dir()


@contextmanager
def _as_admin(admin: Admin) -> Iterator[Any]:
    """The admin's keystore, opened in this process (its Vault address and root token for the block)."""
    from mrtr_keys.keystores import open_keystore

    saved = {k: os.environ.get(k) for k in ("VAULT_ADDR", "VAULT_TOKEN")}
    os.environ.update({"VAULT_ADDR": admin.env["VAULT_ADDR"], "VAULT_TOKEN": admin.env["VAULT_TOKEN"]})
    try:
        yield open_keystore(admin.env["MRTR_KEYS_KEYSTORE"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _backdate(admin: Admin, *, days: float = 0, seconds: float = 0) -> None:
    """Rewrite the stored ring as if its primary had been created and promoted that long ago (a test-only
    edit, as the admin with the root token; the pods load it as one more generation)."""
    from mrtr_keys.ring.model import utcnow

    with _as_admin(admin) as store:
        ring = store.load()
        old = utcnow() - timedelta(days=days, seconds=seconds)
        keys = tuple(replace(k, created_at=old, promoted_at=old) if k.kid == ring.primary.kid else k for k in ring.keys)
        store.save(ring.next_generation(keys=keys), expected_generation=ring.generation)


def _ring_generation(admin: Admin) -> int:
    with _as_admin(admin) as store:
        return int(store.load().generation)


def _wait(what: Callable[[], Any], why: str | Callable[[], str], timeout: float = BOUND) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        assert time.monotonic() < deadline, why if isinstance(why, str) else why()
        time.sleep(0.1)


def test_the_cronjob_waits_until_both_sidecar_pods_loaded_each_generation(
    cluster: Cluster, admin: Admin, postgres_url: str
) -> None:
    from mrtr_keys.audit.writing.stores.base import Query
    from mrtr_keys.audit.writing.stores.url import open_store
    from mrtr_keys.fleet.presence import read_instances

    image = read_image()
    registry = Path(admin.env["MRTR_KEYS_STATE_DIR"]) / "clients.json"
    added = admin.run("clients", "add", "billing", "--audience", "billing", "--clients", str(registry), "--json")
    _backdate(admin, days=31)  # the primary is due: this hour's run begins a rotation
    secrets = {("mrtr-keys-audit", "url"): postgres_url}
    files = {"mrtr-keys-clients/clients.json": registry.read_bytes(), **admin.secret_files()}
    client_secret = json.loads(added.stdout)["secret"]
    boxes = [Sandbox() for _ in range(3)]
    store = open_store(postgres_url)
    try:
        with CountingProxy(int(cluster.bao.addr.rsplit(":", 1)[1])) as net_b:
            pods: dict[str, tuple[Sandbox, subprocess.Popen[bytes], dict[str, str]]] = {}
            for name, box, vault in (
                ("mcp-billing-a", boxes[0], cluster.bao.addr),
                ("mcp-billing-b", boxes[1], net_b.url),
            ):
                env = SIDECAR_POD.lay_out(
                    box, image, pod_name=name, secrets=secrets, token=cluster.token(SIDECAR_POD), files=files
                )
                assert env["VAULT_ADDR"] == VAULT_IN_MANIFESTS and "VAULT_TOKEN" not in env
                env["VAULT_ADDR"] = vault
                pods[name] = (box, box.start(SIDECAR_POD.argv(image), env, cwd=image.workdir, name=name), env)
            for box, proc, env in pods.values():
                _ready(box, proc, env, image.workdir)
            _one_fingerprint_across_the_fleet(admin, pods, client_secret)

            def presence() -> dict[str, tuple[int | None, str | None]]:
                return {r.name: (r.generation, r.note) for r in read_instances(store) if r.name in pods}

            def loaded(generation: int) -> dict[str, float]:
                """When each pod first recorded `ring-loaded` for `generation` or a later one (a pod may skip
                one written just before another); the audit instance is host:pid:start."""
                out: dict[str, float] = {}
                for rec in store.query(Query(op="ring-loaded")):
                    for name, (_, proc, _) in pods.items():
                        if f":{proc.pid}:" in rec.event.instance and (rec.event.generation or 0) >= generation:
                            out[name] = min(out.get(name, math.inf), _ts(rec.event.time))
                return out

            def changed(op: str) -> float:
                (rec,) = list(store.query(Query(op=op)))
                return _ts(rec.event.time)

            generation = _ring_generation(admin)
            _wait(lambda: all(g == generation for g, _ in presence().values()) and len(presence()) == 2, "pods not up")

            cron_box = boxes[2]
            cron_env = ROTATION.lay_out(
                cron_box, image, pod_name="rotation-1", secrets=secrets, token=cluster.token(ROTATION), files=files
            )
            cron_env["VAULT_ADDR"] = cluster.bao.addr

            # Pod b loses its network to Vault (its heartbeats to PostgreSQL still go): it stays live on its
            # generation, so the next run, which would promote, must wait for it and say so.
            net_b.stop()
            begun = cron_box.run(ROTATION.argv(image), cron_env, cwd=image.workdir, timeout=300)
            assert begun.returncode == 0 and "phase 1:" in begun.stdout, begun.stdout + begun.stderr
            begin_gen = _ring_generation(admin)
            _wait(lambda: "mcp-billing-a" in loaded(begin_gen), "pod a never loaded the begin")
            cron = cron_box.start(ROTATION.argv(image), cron_env, cwd=image.workdir, name="rotation-promote")
            _wait(
                lambda: "not yet: mcp-billing-b" in cron_box.output(cron),
                "the CronJob does not name the pod it waits for",
            )
            _wait(
                lambda: (presence()["mcp-billing-b"][1] or "").startswith("keystore:"), "pod b reports no keystore note"
            )
            # Pod a loaded the begin and pod b's failed check is in its heartbeat: the CronJob is still waiting.
            assert presence()["mcp-billing-b"][0] == begin_gen - 1, presence()
            assert cron.poll() is None and "mcp-billing-b" not in loaded(begin_gen), cron_box.output(cron)
            status = admin.run("fleet", "status").stdout
            assert "mcp-billing-b: keystore: " in status and "2 live" in status, status  # the operator sees why
            net_b.start()  # pod b reaches Vault again: it loads the begin, and only then does the CronJob promote
            assert cron.wait(BOUND) == 0, cron_box.output(cron)
            assert "phase 2:" in cron_box.output(cron)
            by_b = loaded(begin_gen)
            assert set(by_b) == set(pods) and changed("promote") > max(by_b.values())
            promote_gen = _ring_generation(admin)

            # At once (the pods may not have loaded the promote yet): the next run retires only after both did.
            _backdate(admin, seconds=TTL + 61)  # as if the TTL + 60 s since the promote had passed
            retired = cron_box.run(ROTATION.argv(image), cron_env, cwd=image.workdir, timeout=300)
            assert retired.returncode == 0 and "phase 3:" in retired.stdout, retired.stdout + retired.stderr
            by_p = loaded(promote_gen)
            assert set(by_p) == set(pods) and changed("retire") > max(by_p.values())
            final = _ring_generation(admin)
            _wait(lambda: all(g == final for g, _ in presence().values()), "a pod never loaded the retire")
            status = admin.run("fleet", "status").stdout
            assert status.splitlines()[0].endswith(f"generation {final}: 2 live, 0 stale, 0 stopped"), status
            for _, (box, proc, _) in pods.items():
                assert proc.poll() is None, box.output(proc)
    finally:
        store.close()
        for box in boxes:
            box.stop()


def _one_fingerprint_across_the_fleet(
    admin: Admin, pods: dict[str, tuple[Sandbox, subprocess.Popen[bytes], dict[str, str]]], secret: str
) -> None:
    """Both pods fingerprint with the fleet's one key (Secret mrtr-keys-audit-key, MRTR_KEYS_AUDIT_KEY_FILE):
    a token sealed by pod a and unsealed by pod b is found by `audit query --token` in the rows of both, and
    no pod made a key of its own in its emptyDir."""
    import httpx

    def call(name: str, path: str, body: dict[str, str]) -> dict[str, Any]:
        box = pods[name][0]
        argv = SIDECAR_POD.container["command"]
        sock = box.path(argv[argv.index("--uds") + 1])
        transport = httpx.HTTPTransport(uds=str(sock))
        with httpx.Client(base_url="http://sidecar", transport=transport, timeout=10) as http:
            r = http.post(path, json=body, headers={"authorization": f"Bearer {secret}"})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    token = call("mcp-billing-a", "/v1/seal", {"audience": "billing", "payload": "eyJzdGVwIjoxfQ"})["token"]
    call("mcp-billing-b", "/v1/unseal", {"audience": "billing", "token": token})

    def found() -> list[dict[str, Any]]:
        done = admin.run("audit", "query", "--token", token, "--json")
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    def by_pod(rows: list[dict[str, Any]]) -> dict[str, str]:
        return {name: r["op"] for r in rows for name, (_, proc, _) in pods.items() if f":{proc.pid}:" in r["instance"]}

    rows = _wait(lambda: (r := found()) and len(by_pod(r)) == 2 and r, lambda: f"rows of one token: {found()}")
    assert by_pod(rows) == {"mcp-billing-a": "seal", "mcp-billing-b": "unseal"}, rows
    assert len({r["fingerprint"] for r in rows}) == 1, rows
    for box, _, _ in pods.values():
        assert not (box.path(SIDECAR_POD.value("MRTR_KEYS_STATE_DIR")) / "audit.key").exists()


def _ready(box: Sandbox, proc: subprocess.Popen[bytes], env: dict[str, str], cwd: str) -> None:
    """Until the sidecar's readiness probe (as written; its socket URL maps into the pod's sandbox as every
    container path does) exits 0."""
    probe = [
        a.replace("unix:///", f"unix://{box.root}/") for a in SIDECAR_POD.container["readinessProbe"]["exec"]["command"]
    ]
    _wait(
        lambda: proc.poll() is not None or box.run(probe, env, cwd=cwd).returncode == 0,
        lambda: box.output(proc) + str(box.run(probe, env, cwd=cwd)),
    )
    assert proc.poll() is None, box.output(proc)


def _ts(text: str) -> float:
    from mrtr_keys.audit.events import parse_event_time

    return parse_event_time(text).timestamp()
