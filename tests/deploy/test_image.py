"""The Dockerfile, checked without a container runtime (docs/deploy.md).

hadolint lints it; then the image's own ENTRYPOINT + CMD run with its ENV, WORKDIR and USER (10001),
the key ring and client registry read-only in /etc/mrtr-keys, only /var/lib/mrtr-keys writable; its
HEALTHCHECK command must pass, a seal and an unseal go through the sidecar, and nothing is written
outside the state directory.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from mrtr_keys.changes.create import create_ring
from mrtr_keys.codecs.sidecar_client import SidecarCodec
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.service.clients import add_client
from tests.deploy.sandbox import REPO, UID, Sandbox, read_image, written_outside

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
