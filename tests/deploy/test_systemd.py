"""deploy/mrtr-keys-sidecar.service and the install steps of docs/deploy.md, without systemd.

The unit is parsed with configparser; the install block is read from docs/deploy.md and run in a
throwaway root (docs/deploy.md says which lines are stood in for: useradd, the venv and pip, systemctl).
Then ExecStart runs with the unit's Environment as uid 10001 (the ``mrtr-keys`` user), umask from
UMask=, its StateDirectory and RuntimeDirectory created as systemd does (0700, owned by the user), and
nothing else writable; a seal and an unseal go through the socket, and ExecReload is sent.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import subprocess
import time

import pytest

from mrtr_keys.codecs.sidecar_client import SidecarCodec
from tests.deploy.sandbox import REPO, UID, Sandbox
from tests.docs.doc_blocks import parse_page

pytestmark = pytest.mark.e2e
UNIT = REPO / "deploy" / "mrtr-keys-sidecar.service"
STOOD_IN = ("useradd ", "python3 -m venv ", "/opt/mrtr-keys/bin/pip install ", "systemctl ")


def install_block() -> list[str]:
    page = parse_page(REPO / "docs" / "deploy.md")
    (block,) = [b for b in page.blocks if b.directives.get("run-by") == "tests/deploy/test_systemd.py"]
    return [line for line in block.text.splitlines() if line.strip()]


def read_unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read_string(UNIT.read_text())
    return unit


def test_install_steps_and_unit_serve_as_the_service_user(box: Sandbox) -> None:
    unit = read_unit()
    service = unit["Service"]
    assert service["User"] == service["Group"] == "mrtr-keys"
    assert service["ProtectSystem"] == "strict" and service["ReadWritePaths"] == "/var/lib/mrtr-keys"

    box.make_dir("/etc/systemd/system", writable=False)  # there on any systemd host
    secret = ""
    for line in install_block():
        if line.startswith(STOOD_IN):
            if line.startswith("useradd "):
                assert "--home-dir /var/lib/mrtr-keys" in line and line.endswith(" mrtr-keys")
            continue
        line = re.sub(r"-([og]) mrtr-keys\b", rf"-\1 {UID}", line)
        argv = shlex.split(line.replace("deploy/", f"{REPO}/deploy/", 1) if line.startswith("install -m") else line)
        as_user = argv[:3] == ["runuser", "-u", "mrtr-keys"]
        if as_user:
            argv = argv[4:]  # runuser -u mrtr-keys -- CMD
            done = box.run(argv, {}, cwd="/var/lib/mrtr-keys")
        else:
            done = subprocess.run([box.translate(a) for a in argv], capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
        if "clients add" in line:
            import json

            secret = json.loads(done.stdout)["secret"]
    installed = box.path("/etc/systemd/system/mrtr-keys-sidecar.service")
    assert installed.read_text() == UNIT.read_text() and secret

    # systemctl enable --now: systemd creates the directories, then runs ExecStart as the user.
    box.make_dir("/run/mrtr-keys", writable=True)
    state = box.path("/var/lib/mrtr-keys")
    assert state.stat().st_uid == UID and state.stat().st_mode & 0o777 == 0o700
    env = dict(kv.split("=", 1) for kv in shlex.split(service["Environment"]))
    env["HOME"] = "/var/lib/mrtr-keys"
    argv = shlex.split(service["ExecStart"])
    old_umask = os.umask(int(service["UMask"], 8))
    try:
        proc = box.start(argv, env, cwd="/", name="systemd")
    finally:
        os.umask(old_umask)
    sock = box.path("/run/mrtr-keys/sidecar.sock")
    health = [str(box.path("/opt/mrtr-keys/bin/mrtr-keys")), "health", "--url", f"unix://{sock}", "--wait", "60"]
    up = subprocess.run(health, capture_output=True, text=True, check=False)
    assert up.returncode == 0, up.stderr + box.output(proc)
    assert sock.stat().st_mode & 0o777 == 0o600 and sock.stat().st_uid == UID

    with SidecarCodec(f"unix://{sock}", audience="billing", secret=secret) as codec:
        token = codec.seal(b"round one")
        assert codec.unseal(token) == b"round one"
        # ExecReload=/bin/kill -HUP $MAINPID: the sidecar re-reads at once and keeps serving.
        reload = shlex.split(service["ExecReload"].replace("$MAINPID", str(proc.pid)))
        assert subprocess.run(reload, check=False).returncode == 0
        time.sleep(0.3)
        assert proc.poll() is None, box.output(proc)
        assert codec.unseal(codec.seal(b"after reload")) == b"after reload"
    written = sorted(p.name for p in state.iterdir())
    assert "keyring.json" in written and "audit.key" in written, written
