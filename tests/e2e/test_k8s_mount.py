"""The shipped Kubernetes manifest, run as written: deploy/kubernetes/sidecar-secret-mount.yaml's sidecar
command and environment, as its non-root user, with the ring and client registry on a directory laid out
as the kubelet lays out a Secret volume (``..data`` link, files 0440 root:fsGroup), the fleet's audit key on
another, presence and audit in the shared PostgreSQL store (the Secret mrtr-keys-audit's URL) and only the
state directory writable. The mount is swapped the kubelet's way through begin, promote and retire while the
MCP server side (`request_state_security` reading the manifest's MRTR_KEYS_SIDECAR_* variables) seals and
unseals continuously: 0 failed requests, no restart, nothing written to the mounts; the pod's heartbeat (what
the rotation CronJob's gates read) follows each generation, and its audit rows carry the fleet key's
fingerprints (issue 39, item 7)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

import mrtr_keys
from mrtr_keys.audit.writing.stores.base import Query
from mrtr_keys.audit.writing.stores.url import open_store
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.fleet.presence import read_instances
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.service.clients import add_client
from tests.fixtures.common import REPO, run_cli, stop_process
from tests.fixtures.keystores import kubelet_publish
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

MANIFEST = REPO / "deploy" / "kubernetes" / "sidecar-secret-mount.yaml"
POD = "mcp-billing-7d9f-test"  # the downward API's metadata.name


def world_reachable(path: Path) -> bool:
    """True if a user who is neither owner nor group can execute `path` (every parent searchable)."""
    real = Path(os.path.realpath(path))
    return all(os.stat(p).st_mode & 0o001 for p in [real, *real.parents])


def pod_toolchain(base: Path) -> tuple[Path, dict[str, str]]:
    """A ``bin`` directory with ``mrtr-keys`` and ``python`` as the image has them, runnable by the pod's
    user, and the environment they need. This venv's interpreter is used when that user can reach it;
    else (a pyenv under a 0700 home) the system's Python of the same version runs this venv's packages."""
    bin_dir = base / "bin"
    bin_dir.mkdir(mode=0o755)
    python, env = sys.executable, {}
    if not world_reachable(Path(python)):
        python = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/bin") or ""
        assert python and world_reachable(Path(python)), "no Python the pod user can run"
        site = next(p for p in sys.path if p.endswith("site-packages") and "venv" in p)
        env["PYTHONPATH"] = f"{REPO / 'src'}:{site}"
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {python} "$@"\n')
    (bin_dir / "mrtr-keys").write_text(f'#!/bin/sh\nexec {python} -m mrtr_keys.cli.main "$@"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir, env


def pod_spec() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def containers(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    sidecar = next(c for c in spec["containers"] if c.get("command", [""])[0] == "mrtr-keys")
    server = next(c for c in spec["containers"] if c is not sidecar)
    return sidecar, server


def test_every_variable_the_manifests_set_is_read_by_the_code() -> None:
    names = {e["name"] for c in pod_spec()["containers"] for e in c.get("env", [])}
    for path in (REPO / "deploy" / "kubernetes").glob("*.yaml"):
        for doc in filter(None, yaml.safe_load_all(path.read_text())):
            spec = doc.get("spec", {})
            pod = spec.get("jobTemplate", {}).get("spec", spec).get("template", {}).get("spec", {})
            names |= {e["name"] for c in pod.get("containers", []) for e in c.get("env", [])}
    source = "\n".join(p.read_text() for p in (REPO / "src" / "mrtr_keys").rglob("*.py"))
    assert names and {n for n in names if f'"{n}"' not in source} == set()


def test_the_sidecar_serves_through_a_kubelet_swapped_rotation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, postgres_url: str
) -> None:
    spec = pod_spec()
    sidecar, server = containers(spec)
    security = spec["securityContext"]
    root = os.geteuid() == 0
    base = Path(tempfile.mkdtemp(prefix="mrtr-k8s-"))  # outside pytest's 0700 tmp tree: the pod user must reach it
    os.chmod(base, 0o755)
    volumes = {v["name"]: v for v in spec["volumes"]}
    paths: dict[str, Path] = {}
    secrets: dict[str, tuple[Path, int]] = {}  # Secret name -> (its mount here, defaultMode)
    for vm in sidecar["volumeMounts"]:
        host = base / vm["name"]
        paths[vm["mountPath"]] = host
        if "secret" in volumes[vm["name"]]:
            secret = volumes[vm["name"]]["secret"]
            secrets[secret["secretName"]] = (host, secret["defaultMode"])
        else:  # emptyDir: writable by the pod's user only
            host.mkdir(mode=0o700)
            if root:
                os.chown(host, security["runAsUser"], security["runAsGroup"])
    assert set(secrets) == {"mrtr-keyring", "mrtr-keys-audit-key"}
    (mount, mode), (key_mount, key_mode) = secrets["mrtr-keyring"], secrets["mrtr-keys-audit-key"]
    assert mode == key_mode == 0o440

    source = FileKeystore(tmp_path / "source" / "keyring.json")  # where rotations are written (not the pod)
    create_ring(source, audiences=("billing",))
    registry = tmp_path / "source" / "clients.json"
    _, client_secret = add_client(registry, "billing", audiences=["billing"])
    gid = security["fsGroup"] if root else None

    def publish() -> None:
        kubelet_publish(
            mount, {"keyring.json": source.path.read_bytes(), "clients.json": registry.read_bytes()}, mode=mode, gid=gid
        )

    publish()
    audit_key = os.urandom(32)  # head -c 32 /dev/urandom > audit.key; the Secret mrtr-keys-audit-key
    kubelet_publish(key_mount, {"audit.key": audit_key}, mode=key_mode, gid=gid)
    secret_values = {("mcp-billing-sidecar-client", "secret"): client_secret, ("mrtr-keys-audit", "url"): postgres_url}

    def local(text: str) -> str:
        for pod_path in sorted(paths, key=len, reverse=True):
            text = text.replace(pod_path, str(paths[pod_path]))
        return text

    def env_of(container: dict[str, Any]) -> dict[str, str]:
        out: dict[str, str] = {}
        for e in container.get("env", []):
            if "value" in e:
                out[e["name"]] = local(e["value"])
            elif "secretKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["secretKeyRef"]
                out[e["name"]] = secret_values[(ref["name"], ref["key"])]
            else:  # the downward API
                out[e["name"]] = POD
        return out

    bin_dir, tool_env = pod_toolchain(base)
    argv = [str(bin_dir / "mrtr-keys"), *(local(a) for a in sidecar["command"][1:])]
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": "/nonexistent", **tool_env, **env_of(sidecar)}
    user = {"user": security["runAsUser"], "group": security["runAsGroup"], "extra_groups": [security["fsGroup"]]}
    log = open(base / "sidecar.log", "w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=base, **(user if root else {}))
    socket_path = Path(re.sub(r"^unix://", "", env_of(server)["MRTR_KEYS_SIDECAR_URL"]))
    try:
        http = _wait_ready(proc, socket_path, base / "sidecar.log")
        for name, value in env_of(server).items():  # the MCP server container's environment
            monkeypatch.setenv(name, value)
        codec = mrtr_keys.request_state_security(audience="billing").codec
        keys = {"authorization": f"Bearer {client_secret}"}

        def generation() -> int:
            return int(http.get("/v1/keys", headers=keys).json()["generation"])

        failures: list[str] = []
        rounds: list[int] = []
        stop = threading.Event()

        def traffic(n: int) -> None:
            while not stop.is_set():
                payload = f"{n}-{len(rounds)}".encode()
                try:
                    if codec.unseal(codec.seal(payload)) != payload:
                        failures.append("mismatch")
                except Exception as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                rounds.append(1)

        threads = [threading.Thread(target=traffic, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        generations = []
        try:
            for step in ("begin", "promote", "retire"):
                result = run_step(source, step, force=step == "retire")
                generations.append(result.ring.generation)
                publish()
                deadline = time.monotonic() + 30
                while generation() != result.ring.generation:
                    assert time.monotonic() < deadline, (base / "sidecar.log").read_text()
                    time.sleep(0.1)
                time.sleep(0.3)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        assert failures == [] and len(rounds) > 50
        print(f"\nk8s mount: {len(rounds)} seal+unseal rounds through begin/promote/retire swaps, 0 failed")
        assert proc.poll() is None
        for kind in ("readinessProbe", "livenessProbe"):  # the probes as the kubelet execs them
            probe = [local(a) for a in sidecar[kind]["exec"]["command"]]
            probe[0] = str(bin_dir / probe[0])
            ran = subprocess.run(probe, env=env, timeout=60, check=False, capture_output=True, **(user if root else {}))
            assert ran.returncode == 0, (kind, ran.stderr)
        _in_the_fleet(proc.pid, postgres_url, generations, audit_key, codec.seal(b"one more round"), tmp_path)
        state = paths[next(p for p in paths if "state" in p or "lib" in p)]
        assert not {"audit.key", "audit.db"} & {p.name for p in state.iterdir()}  # the fleet's, not its own
        assert sorted(p.name for p in mount.iterdir() if not p.name.startswith("..2")) == [
            "..data",
            "clients.json",
            "keyring.json",
        ]
    finally:
        stop_process(proc)
        log.close()


def _in_the_fleet(pid: int, store_url: str, generations: list[int], audit_key: bytes, token: str, tmp: Path) -> None:
    """What the rotation CronJob's gates and an operator read from the shared store: the pod's heartbeat at the
    last generation under its pod name, its `ring-loaded` record of each one, and the token it sealed found by
    `mrtr-keys audit query --token` with the fleet's audit key (one fingerprint fleet-wide)."""
    store = open_store(store_url)
    try:

        def heartbeat() -> bool:
            return any(r.name == POD and r.generation == generations[-1] for r in read_instances(store))

        until(heartbeat, 30, f"{POD}'s heartbeat at generation {generations[-1]}", every=0.2)
        loaded = {r.event.generation for r in store.query(Query(op="ring-loaded")) if f":{pid}:" in r.event.instance}
        assert set(generations) <= loaded, loaded
    finally:
        store.close()
    key_file = tmp / "audit.key"
    key_file.write_bytes(audit_key)
    key_file.chmod(0o600)
    env = {"MRTR_KEYS_AUDIT": store_url, "MRTR_KEYS_AUDIT_KEY_FILE": str(key_file)}

    def found() -> list[dict[str, object]]:
        done = run_cli("audit", "query", "--token", token, "--json", env=env)
        assert done.code == 0, done.err
        return [r for r in json.loads(done.out) if r["op"] == "seal"]

    until(found, 30, "the sealed token in the shared audit log", every=0.2)


def _wait_ready(proc: subprocess.Popen[Any], socket_path: Path, log: Path) -> httpx.Client:
    http = httpx.Client(base_url="http://sidecar", transport=httpx.HTTPTransport(uds=str(socket_path)), timeout=10)
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if http.get("/readyz").status_code == 200:
                return http
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
