"""Services the benchmark starts itself (OpenBao dev server, moto server, the sidecar) and always stops.

Everything listens on a free 127.0.0.1 port and lives under one temporary directory. The launchers,
ports and the counting proxy are the tests' own (`tests.support`), so the two cannot drift apart.
`Services` starts each one lazily on first use, so `python -m bench cli_time` never
starts OpenBao; `close()` (or leaving the `with` block) stops all of them, even after
an error or Ctrl-C.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.net import stop_process
from tests.support.proxy import Classify, CountingProxy
from tests.support.services import start_moto, start_openbao

__all__ = ["AUDIENCE", "VAULT_TOKEN", "CountingProxy", "Services", "module_available", "rss_kib"]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
VAULT_TOKEN = "root"
AUDIENCE = "bench"


def module_available(name: str) -> bool:
    """True if `name` (e.g. ``mrtr_keys.backends.kms``) exists in this tree."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def rss_kib(pid: int) -> int:
    """Resident set size of `pid` plus all its descendants (KiB), from /proc."""
    total = 0
    for p in [pid, *_descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    children: list[str] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):  # a child started from a thread is listed under it
        try:
            children += (task / "children").read_text().split()
        except OSError:
            continue
    for c in children:
        out.append(int(c))
        out.extend(_descendants(int(c)))
    return out


class OpenBao:
    """`bao server -dev` on a free loopback port with a transit mount, root token ``root``.

    Like for like with the sidecar, which records every request in its audit log by default, the
    server writes a file audit log (as any production Vault / OpenBao does; OpenBao 2.x enables
    audit devices only from configuration).
    """

    def __init__(self, workdir: Path) -> None:
        config = workdir / "openbao-audit.hcl"
        audit_log = workdir / "openbao-audit.log"
        config.write_text(f'audit "file" "bench" {{\n  options {{\n    file_path = "{audit_log}"\n  }}\n}}\n')
        self._server = start_openbao(workdir, token=VAULT_TOKEN, config=config, env={"BAO_LOG_LEVEL": "warn"})
        self.proc = self._server.proc
        self.port = self._server.port
        self.addr = self._server.url
        self._wait_unsealed()
        self.request("POST", "/v1/sys/mounts/transit", {"type": "transit"})

    def _wait_unsealed(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if not self.request("GET", "/v1/sys/seal-status")["sealed"]:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError("OpenBao dev server did not unseal")

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.addr + path, data=data, method=method)
        req.add_header("X-Vault-Token", VAULT_TOKEN)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=30) as resp:
            text = resp.read()
        return json.loads(text) if text else None

    def env(self) -> dict[str, str]:
        return {"VAULT_ADDR": self.addr, "VAULT_TOKEN": VAULT_TOKEN, "BAO_ADDR": self.addr, "BAO_TOKEN": VAULT_TOKEN}

    def stop(self) -> None:
        self._server.stop()


class Moto:
    """moto in server mode (``python -m moto.server``, a subprocess) for KMS."""

    def __init__(self, workdir: Path) -> None:
        self._server = start_moto(workdir)
        self.proc = self._server.proc
        self.port = self._server.port
        self.url = self._server.url

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
        }

    def stop(self) -> None:
        self._server.stop()


class Services(AbstractContextManager["Services"]):
    """Lazily started shared services for one benchmark run, all stopped by `close()`."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="mrtr-bench-"))
        self._bao: OpenBao | None = None
        self._moto: Moto | None = None
        self._procs: list[subprocess.Popen[Any]] = []
        self._proxies: list[CountingProxy] = []

    def proxy(self, target_port: int, *, classify: Classify | None = None) -> CountingProxy:
        """A `CountingProxy` to 127.0.0.1:`target_port` (counting by `classify`), closed by `close()`."""
        proxy = CountingProxy(target_port, classify=classify)
        self._proxies.append(proxy)
        return proxy

    @property
    def bao(self) -> OpenBao:
        if self._bao is None:
            self._bao = OpenBao(self.workdir)
        return self._bao

    @property
    def moto(self) -> Moto:
        if self._moto is None:
            self._moto = Moto(self.workdir)
        return self._moto

    def track(self, proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
        """Stop `proc` at `close()` too (a sidecar a part started)."""
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self._procs):
            stop_process(proc)
        self._procs.clear()
        for proxy in self._proxies:
            proxy.close()
        self._proxies.clear()
        if self._moto is not None:
            self._moto.stop()
            self._moto = None
        if self._bao is not None:
            self._bao.stop()
            self._bao = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
