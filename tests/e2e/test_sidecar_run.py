"""`make run` (``python -m mrtr_keys.run``): the sidecar on embedded defaults, loopback only."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.support.net import launch_on_free_port, port_open, stop_process

RUN = [sys.executable, "-m", "mrtr_keys.run"]


def _env(port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRTR_KEYS_")}
    env["MRTR_KEYS_PORT"] = str(port)
    return env


def test_make_run_creates_state_serves_on_loopback_and_never_prints_the_secret(tmp_path: Path) -> None:
    def start(port: int) -> tuple[subprocess.Popen[Any], Path]:
        log = tmp_path / f"run-{port}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(RUN, cwd=tmp_path, env=_env(port), stdout=out, stderr=subprocess.STDOUT)
        return proc, log

    server = launch_on_free_port(start, ready=lambda port: port_open(port))
    port = server.port
    try:
        secret_file = tmp_path / ".mrtr" / "sidecar.secret"
        assert secret_file.stat().st_mode & 0o777 == 0o600
        secret = secret_file.read_text().strip()
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/seal",
            json={"audience": "demo", "payload": "aGk"},
            headers={"authorization": f"Bearer {secret}"},
        )
        assert r.status_code == 200 and r.json()["token"].startswith("mk2.")
        printed = server.output()
        assert secret not in printed
        assert "request_state_security(" in printed and f"http://127.0.0.1:{port}" in printed
        assert (tmp_path / ".mrtr" / "keyring.json").exists()
    finally:
        stop_process(server.proc)


def test_make_run_on_a_busy_port_says_so_in_one_line_before_any_banner(tmp_path: Path) -> None:
    """Like ``mrtr-keys serve``, a port in use is one line on stderr, exit 2, no banner."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(RUN, cwd=tmp_path, env=_env(port), capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "Plug an MCP server" not in run.stdout and "sealing sidecar on" not in run.stdout
    assert run.stderr.strip().splitlines() == [f"mrtr-keys: cannot listen on 127.0.0.1:{port}: Address already in use"]


def test_make_run_refuses_a_port_that_is_not_a_port(tmp_path: Path) -> None:
    """``MRTR_KEYS_PORT`` must be an integer from 1 to 65535: one line, exit 2."""
    for bad in ("http", "0", "70000"):
        env = {**_env(1), "MRTR_KEYS_PORT": bad}
        run = subprocess.run(RUN, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
        assert run.returncode == 2, (bad, run.stderr)
        assert run.stderr.strip().splitlines() == [
            f"mrtr-keys: MRTR_KEYS_PORT must be an integer from 1 to 65535, not {bad!r}"
        ]
