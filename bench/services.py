"""Services the benchmark starts itself (OpenBao dev server, moto server, the sidecar) and always stops.

Everything listens on a free 127.0.0.1 port and lives under one temporary directory.
`Services` starts each one lazily on first use, so `python -m bench cli_time` never
starts OpenBao; `close()` (or leaving the `with` block) stops all of them, even after
an error or Ctrl-C.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
VAULT_TOKEN = "root"
AUDIENCE = "bench"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, *, proc: subprocess.Popen[Any] | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on port {port}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


def stop(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


def module_available(name: str) -> bool:
    """True if `name` (e.g. ``mrtr_keys.backends.kms.backend``) exists in this tree."""
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
        self.port = free_port()
        self.addr = f"http://127.0.0.1:{self.port}"
        self._log = open(workdir / "openbao.log", "wb")
        config = workdir / "openbao-audit.hcl"
        audit_log = workdir / "openbao-audit.log"
        config.write_text(f'audit "file" "bench" {{\n  options {{\n    file_path = "{audit_log}"\n  }}\n}}\n')
        self.proc = subprocess.Popen(
            [
                str(BIN / "bao"),
                "server",
                "-dev",
                f"-dev-listen-address=127.0.0.1:{self.port}",
                f"-dev-root-token-id={VAULT_TOKEN}",
                f"-config={config}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HOME": str(workdir), "BAO_LOG_LEVEL": "warn"},
        )
        wait_for_port(self.port, proc=self.proc)
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
        stop(self.proc)
        self._log.close()


class Moto:
    """moto in server mode (``python -m moto.server``, a subprocess) for KMS."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(workdir / "moto.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        wait_for_port(self.port, proc=self.proc)

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
        }

    def stop(self) -> None:
        stop(self.proc)
        self._log.close()


class Services(AbstractContextManager["Services"]):
    """Lazily started shared services for one benchmark run, all stopped by `close()`."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="mrtr-bench-"))
        self._bao: OpenBao | None = None
        self._moto: Moto | None = None
        self._procs: list[subprocess.Popen[Any]] = []
        self._proxies: list[CountingProxy] = []

    def proxy(self, target_port: int) -> CountingProxy:
        """A `CountingProxy` to 127.0.0.1:`target_port`, closed by `close()`."""
        proxy = CountingProxy(target_port)
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
            stop(proc)
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


class CountingProxy:
    """A loopback TCP forwarder that counts the HTTP requests going through it (`requests`).

    Used to prove that a data-key codec makes no call to its key service per token:
    the codec is pointed at the proxy, and the count is read before and after the loop.
    A request is counted by its request line (``... HTTP/1.1``) in the client-to-server stream.
    """

    def __init__(self, target_port: int) -> None:
        import threading

        self.target_port = target_port
        self.requests = 0
        self.bytes_up = 0
        self._lock = threading.Lock()
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port = int(self._server.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if up:
                    with self._lock:
                        self.bytes_up += len(data)
                        self.requests += data.count(b" HTTP/1.1\r\n")
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self._server.close()
