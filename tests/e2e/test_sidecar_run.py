"""`make run` (``python -m mrtr_keys.run``): the sidecar on embedded defaults, loopback only (issue 4)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.fixtures.common import free_port, stop_process


def test_make_run_creates_state_serves_on_loopback_and_never_prints_the_secret(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRTR_KEYS_")}
    env["MRTR_KEYS_PORT"] = str(port)
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mrtr_keys.run"], cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        secret_file = tmp_path / ".mrtr" / "sidecar.secret"
        assert secret_file.stat().st_mode & 0o777 == 0o600
        secret = secret_file.read_text().strip()
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/seal",
            json={"audience": "demo", "payload": "aGk"},
            headers={"authorization": f"Bearer {secret}"},
        )
        assert r.status_code == 200 and r.json()["token"].startswith("mk1.")
        printed = log.read_text()
        assert secret not in printed
        assert "request_state_security(" in printed and f"http://127.0.0.1:{port}" in printed
        assert (tmp_path / ".mrtr" / "keyring.json").exists()
    finally:
        stop_process(proc)
