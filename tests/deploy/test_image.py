"""The Dockerfile, checked without a container runtime (docs/deploy.md).

hadolint lints it; then the image's own ENTRYPOINT + CMD run with its ENV, WORKDIR and USER (10001),
the key ring and client registry read-only in /etc/mrtr-keys, only /var/lib/mrtr-keys writable; its
HEALTHCHECK command must pass, a seal and an unseal go through the sidecar, and nothing is written
outside the state directory.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mrtr_keys.changes.create import create_ring
from mrtr_keys.codecs.sidecar_client import SidecarCodec
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.service.clients import add_client
from tests.deploy.sandbox import REPO, UID, Sandbox, read_image, stages, written_outside

pytestmark = pytest.mark.e2e


def test_hadolint_passes() -> None:
    lint = subprocess.run(
        [str(REPO / ".venv" / "bin" / "hadolint"), str(REPO / "Dockerfile")], capture_output=True, text=True
    )
    assert lint.returncode == 0 and lint.stdout == "", lint.stdout + lint.stderr


def provision_ring(box: Sandbox, directory: str = "/etc/mrtr-keys") -> str:
    """A ring and a client registry (client `web`, audience `web`) in `directory`, files 0400 owned by
    the image's user, the directory root-owned (the process cannot write there). Returns the secret."""
    ring_dir = box.make_dir(directory, writable=False)
    create_ring(FileKeystore(ring_dir / "keyring.json"))
    _, secret = add_client(ring_dir / "clients.json", "web", audiences=["web"], ops=["seal", "unseal"])
    for f in ring_dir.iterdir():
        if f.name.endswith(".json"):
            import os

            os.chown(f, UID, UID)
            f.chmod(0o400)
        else:
            f.unlink()  # lock files of the set-up; the sidecar never writes here
    return secret


def test_image_command_serves_under_the_image_constraints(box: Sandbox) -> None:
    image = read_image()
    assert image.user == "10001:10001" and image.entrypoint == ["mrtr-keys"] and image.healthcheck
    assert image.env["MRTR_KEYS_STATE_DIR"] == image.workdir == "/var/lib/mrtr-keys"
    secret = provision_ring(box)
    box.make_dir(image.env["MRTR_KEYS_STATE_DIR"], writable=True)
    ring_files = sorted(p.name for p in box.path("/etc/mrtr-keys").iterdir())
    started = time.time()

    def env_for(port: int) -> dict[str, str]:  # docker run -e MRTR_KEYS_HOST=... -e MRTR_KEYS_PORT=...
        return {**image.env, "MRTR_KEYS_HOST": "127.0.0.1", "MRTR_KEYS_PORT": str(port)}

    launched = box.launch(
        lambda port: box.start([*image.entrypoint, *image.cmd], env_for(port), cwd=image.workdir, name="image")
    )
    proc, port, env = launched.proc, launched.port, env_for(launched.port)

    deadline = time.monotonic() + 60
    while True:  # what the runtime does: run the HEALTHCHECK command until it passes
        assert proc.poll() is None, box.output(proc)
        check = box.run(image.healthcheck, env, cwd=image.workdir, timeout=30)
        if check.returncode == 0:
            break
        assert time.monotonic() < deadline, check.stderr + box.output(proc)
        time.sleep(0.2)
    assert check.stdout == f"ok: http://127.0.0.1:{port}/healthz answered 200\n"

    with SidecarCodec(f"http://127.0.0.1:{port}", audience="web", secret=secret) as codec:
        token = codec.seal(b"state of round one")
        assert codec.unseal(token) == b"state of round one"

    state = box.path(image.env["MRTR_KEYS_STATE_DIR"])
    assert (state / "audit.key").exists()
    assert sorted(p.name for p in box.path("/etc/mrtr-keys").iterdir()) == ring_files
    assert written_outside(box, started) == []
    logs = [line for line in box.output(proc).splitlines() if line.strip()]
    assert logs and all(line.startswith("{") for line in logs), logs  # MRTR_KEYS_LOG_FORMAT=json


def test_the_image_installs_the_lock_and_carries_its_sbom_and_digest(tmp_path: Path) -> None:
    """What the build installs is uv.lock's (every pip install is --require-hashes from its exports, or the project's
    own wheel built with the locked backend), the image is labelled with the lock's sha256 and holds both SBOMs,
    and the build stage's own check (run here as written, in a directory laid out as its COPYs lay it out)
    passes with `make sbom`'s files and refuses an SBOM or a lock other than the digest's."""
    args, (build, final) = stages()
    digest = hashlib.sha256((REPO / "uv.lock").read_bytes()).hexdigest()
    assert args == {"UV_LOCK_SHA256": digest}
    assert ("LABEL", 'mrtr-keys.uv-lock.sha256="${UV_LOCK_SHA256}"') in final
    assert ("COPY", "--from=build /src/sbom /usr/share/doc/mrtr-keys/sbom") in final
    copies = [rest.split() for word, rest in build if word == "COPY"]
    assert ["build/sbom/python.cdx.json", "build/sbom/typescript.cdx.json", "./sbom/"] in copies
    assert ["uv.lock", "./"] in copies and [
        "requirements/build.txt",
        "requirements/image.txt",
        "./requirements/",
    ] in copies
    runs = [rest for word, rest in build if word == "RUN"]
    installs = [c.strip() for run in runs for c in run.split("&&") if " install " in c]
    assert len(installs) == 3
    for command in installs:
        assert "--require-hashes -r requirements/" in command or command.endswith("--no-deps /wheels/mrtr_keys-*.whl")
    assert "--no-build-isolation" in next(c for run in runs for c in run.split("&&") if " wheel " in c)

    src = tmp_path / "src"  # WORKDIR /src after the COPYs that come before the first RUN
    (src / "sbom").mkdir(parents=True)
    shutil.copy(REPO / "uv.lock", src / "uv.lock")
    made = subprocess.run([sys.executable, str(REPO / "tools" / "sbom.py"), str(src / "sbom")], capture_output=True)
    assert made.returncode == 0, made.stderr
    check = " && ".join(c for c in runs[0].split(" && ") if "venv" not in c and "/opt/build" not in c)

    def build_check() -> int:
        env = {"PATH": "/usr/bin:/bin", "UV_LOCK_SHA256": digest}
        return subprocess.run(["/bin/sh", "-c", check], cwd=src, env=env, capture_output=True).returncode

    assert build_check() == 0
    sbom = src / "sbom" / "python.cdx.json"
    good = sbom.read_text()
    stale = json.loads(good)
    stale["metadata"]["properties"] = [{"name": "mrtr-keys:lock:sha256", "value": "0" * 64}]
    sbom.write_text(json.dumps(stale))
    assert build_check() != 0  # an SBOM of another lock
    sbom.write_text(good)
    with (src / "uv.lock").open("a") as lock:
        lock.write("\n")
    assert build_check() != 0  # a lock other than the one the digest names
