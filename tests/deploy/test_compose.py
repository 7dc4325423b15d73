"""compose.yaml, checked without a container runtime (docs/deploy.md).

Each service runs as compose would start it: the image's ENTRYPOINT / CMD unless the service overrides
them, the image's ENV then the service's ``environment``, in ``depends_on`` order, one-shot services to
completion. ``openbao`` runs its own command (the ``bao`` CLI is a dev dependency); ``postgres`` is the
local PostgreSQL with a throwaway database standing in for the image. Our services run as uid 10001 with
only their volumes writable. Hostnames become loopback addresses and ports free ones; nothing else in a
command or an environment is changed. Then an MCP round trip goes through each example server (sealed
and unsealed by the sidecar), and the audit log in PostgreSQL shows both audiences.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from tests.deploy.sandbox import REPO, Image, Sandbox, read_image
from tests.e2e.servers import first_round, retry_round, text_of
from tests.fixtures.common import run_cli
from tests.support.net import launch_on_free_port, stop_process
from tests.support.services import bao_binary

pytestmark = pytest.mark.e2e
COMPOSE = REPO / "compose.yaml"


def _argv(service: dict[str, Any], image: Image | None) -> list[str]:
    """ENTRYPOINT + CMD as compose resolves them ($$ is a literal $)."""
    entry = service.get("entrypoint", image.entrypoint if image else [])
    cmd = service.get("command", image.cmd if image and "entrypoint" not in service else [])
    entry = entry if isinstance(entry, list) else [entry]
    cmd = cmd if isinstance(cmd, list) else [cmd]
    return [str(a).replace("$$", "$") for a in [*entry, *cmd]]


def _sub(text: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        text = text.replace(old, new)
    return text


def _volumes(box: Sandbox, services: dict[str, Any]) -> None:
    """One directory per named volume (owned by the image's user); a volume mounted at several
    container paths appears at each (symlinks to its first path)."""
    first: dict[str, str] = {}
    for name, svc in services.items():
        if name in ("postgres", "openbao"):
            continue
        for spec in svc.get("volumes", []):
            volume, target = spec.split(":")[:2]
            if volume not in first:
                first[volume] = target
                box.make_dir(target, writable=True)
            elif target != first[volume]:
                link = box.path(target)
                if not link.exists():
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.symlink_to(box.path(first[volume]))


def test_compose_stack_seals_through_the_sidecar(box: Sandbox, postgres_url: str) -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    services: dict[str, Any] = doc["services"]
    assert list(services) == ["postgres", "openbao", "setup", "sidecar", "mcp-billing", "mcp-orders"]
    ours = [n for n, svc in services.items() if svc.get("image", "").startswith("mrtr-keys:")]
    assert ours == ["setup", "sidecar", "mcp-billing", "mcp-orders"]
    assert all(services[n]["read_only"] is True for n in ours)  # read-only root filesystem, volumes writable
    image = read_image()
    pg = services["postgres"]["environment"]
    replacements = {
        f"postgresql://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}": postgres_url,
        "--host 0.0.0.0": "--host 127.0.0.1",
    }
    _volumes(box, services)

    # openbao: its own command (the upstream image's entrypoint is bao), then its healthcheck; the image's
    # version is the one of the bao binary the test runs.
    bao = services["openbao"]
    version = subprocess.run([bao_binary(), "version"], capture_output=True, text=True, check=True).stdout
    assert version.startswith(f"OpenBao v{bao['image'].rsplit(':', 1)[1]} "), (bao["image"], version)
    bao_home = box.root / "openbao-home"
    bao_home.mkdir()
    bao_env = {k: v for k, v in os.environ.items() if not k.startswith(("VAULT_", "BAO_"))} | {"HOME": str(bao_home)}

    def start_bao(port: int) -> tuple[subprocess.Popen[bytes], Path]:
        log = bao_home / f"bao-{port}.log"
        argv = [bao_binary(), *(a.replace("0.0.0.0:8200", f"127.0.0.1:{port}") for a in bao["command"])]
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, env=bao_env, cwd=bao_home, stdout=out, stderr=subprocess.STDOUT)
        return proc, log

    launched = launch_on_free_port(start_bao)
    try:
        addr = f"http://127.0.0.1:{launched.port}"
        replacements.update({"http://openbao:8200": addr, "http://127.0.0.1:8200": addr})
        check = [_sub(a, replacements) for a in bao["healthcheck"]["test"][1:]]
        check[0] = bao_binary() if check[0] == "bao" else check[0]
        deadline = time.monotonic() + 60
        while (status := subprocess.run(check, env=bao_env, capture_output=True, text=True, check=False)).returncode:
            assert time.monotonic() < deadline, (
                f"openbao healthcheck: {status.stdout}{status.stderr}{launched.output()}"
            )
            time.sleep(0.2)
        _run_stack(box, services, image, replacements, postgres_url)
    finally:
        stop_process(launched.proc)


def _env(service: dict[str, Any], image: Image, replacements: dict[str, str], **overrides: str) -> dict[str, str]:
    env = {**image.env, **{k: str(v) for k, v in (service.get("environment") or {}).items()}, **overrides}
    return {k: _sub(v, replacements) for k, v in env.items()}


def _run_stack(
    box: Sandbox, services: dict[str, Any], image: Image, replacements: dict[str, str], postgres_url: str
) -> None:
    setup = services["setup"]
    done = box.run(
        [_sub(a, replacements) for a in _argv(setup, image)],
        _env(setup, image, replacements),
        cwd=image.workdir,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    secrets_dir = box.path(setup["volumes"][1].split(":")[1])
    assert sorted(p.name for p in secrets_dir.glob("*.secret")) == ["billing.secret", "orders.secret"]
    assert {p.stat().st_mode & 0o777 for p in secrets_dir.glob("*.secret")} == {0o600}  # secrets: owner only

    sidecar = services["sidecar"]

    def sidecar_env(port: int) -> dict[str, str]:  # anchors every second here (300 s as written)
        return _env(
            sidecar,
            image,
            replacements,
            MRTR_KEYS_HOST="127.0.0.1",
            MRTR_KEYS_PORT=str(port),
            MRTR_KEYS_AUDIT_ANCHOR_EVERY="1",
        )

    argv = [_sub(a, replacements) for a in _argv(sidecar, image)]
    up = box.launch(lambda port: box.start(argv, sidecar_env(port), cwd=image.workdir, name="sidecar"))
    env = sidecar_env(up.port)
    deadline = time.monotonic() + 60
    while box.run(image.healthcheck, env, cwd=image.workdir).returncode != 0:  # depends_on: service_healthy
        assert up.proc.poll() is None and time.monotonic() < deadline, up.output()
        time.sleep(0.2)
    replacements["http://sidecar:8750"] = f"http://127.0.0.1:{up.port}"

    urls = {}
    for name in ("mcp-billing", "mcp-orders"):
        svc = services[name]

        def start_server(port: int, svc: dict[str, Any] = svc, name: str = name) -> subprocess.Popen[bytes]:
            argv = [_sub(a, replacements).replace("--port 8000", f"--port {port}") for a in _argv(svc, image)]
            return box.start(argv, _env(svc, image, replacements), cwd=image.workdir, name=name)

        server = box.launch(start_server)
        urls[name] = f"http://127.0.0.1:{server.port}/mcp"

    for name, url in urls.items():
        first = anyio.run(first_round, url)
        assert first.request_state and first.request_state.startswith("mk2.")
        done_round = anyio.run(retry_round, url, first.request_state)
        assert "eu-west-1" in text_of(done_round), name

    deadline = time.monotonic() + 15
    while True:  # the sidecar's writer stores its events within its longest wait (docs/audit.md), not at once
        events = run_cli("audit", "query", "--op", "unseal", "--json", "--audit", postgres_url)
        assert events.code == 0, events.err
        opened = {e["audience"] for e in events.json() if e["outcome"] == "ok"}
        if opened == {"billing", "orders"} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert opened == {"billing", "orders"}
    assert {e["client"] for e in events.json()} == {"billing", "orders"}
    key = Path(box.path("/var/lib/mrtr-keys") / "audit.key")
    assert key.exists()
    # the sidecar's anchors, in the volume only it mounts, hold heads that verify (and see every event)
    anchors = sidecar["environment"]["MRTR_KEYS_AUDIT_ANCHOR"]
    assert anchors.endswith("/") and not any(
        anchors.rstrip("/") in str(v) for v in services["postgres"].get("volumes", [])
    )
    place = str(box.path(anchors.rstrip("/"))) + "/"
    deadline = time.monotonic() + 30
    while True:
        verify = run_cli("audit", "verify", "--json", "--audit", postgres_url, "--checkpoints", place,
                         env={"MRTR_KEYS_AUDIT_KEY_FILE": str(key)})  # fmt: skip
        if (verify.code == 0 and verify.json()["checkpoints_checked"] >= 2) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert verify.code == 0 and verify.json()["checkpoints_checked"] >= 2, verify.out + verify.err
