"""A pre-imported `mrtr-keys` that forks one process per CLI call (test harness only; the product is unchanged).

Why: the suite runs the CLI hundreds of times as a subprocess (``run_cli``, as a deploy pipeline would), and each
new interpreter spends most of its CPU importing Typer, pydantic, cryptography and the stores before it does
anything. On a 2-core machine that import is a large share of ``make test``. The zygote imports everything
once; each call is then a ``fork()`` of that process, which runs the real CLI entry point
(`mrtr_keys.cli.main.run`) with the caller's argv, environment, working directory, umask and standard streams
(passed as file descriptors over a Unix socket, ``SCM_RIGHTS``), and exits with its own exit status. The
caller sees what ``subprocess.run`` would give: exit code, stdout, stderr.

Shape, per connection: the caller sends one JSON request with fds 0/1/2; the zygote forks a *keeper* that
forks the CLI process, sends ``pid N``, forwards ``signal N`` lines to it, kills it (SIGKILL) if the caller
goes away, and sends ``exit N`` (negative: killed by signal N) when it ends.

What is not the same as a fresh interpreter, so callers that depend on it do not use the zygote: the parent
process is the keeper (shell completion looks at its parent), modules were imported under the zygote's
environment (none of ours reads the environment at import time), and ``PYTHON*`` variables of the caller
(for example a ``PYTHONPATH`` that hides an extra) cannot take effect: `run` falls back to a subprocess when
they differ from the zygote's.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

_LEN = struct.Struct("!I")
_MODULE = "mrtr_keys.cli.main"  # in a child: the module it runs as __main__


def _python_env(env: dict[str, str]) -> dict[str, str]:
    """The variables that act at interpreter start (PYTHONUNBUFFERED the child applies itself)."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and k != "PYTHONUNBUFFERED"}


# --- the zygote (server side) ------------------------------------------------------------------------------


def _preload() -> None:
    """Import every module of the package (and the clients its commands load lazily) once."""
    import importlib
    import pkgutil

    import mrtr_keys

    for mod in pkgutil.walk_packages(mrtr_keys.__path__, "mrtr_keys."):
        try:
            importlib.import_module(mod.name)
        except Exception:  # an optional extra missing: that command imports it itself, as it would anyway
            pass
    for name in ("psycopg", "hvac", "redis", "boto3", "botocore.session", "httpx"):
        try:
            importlib.import_module(name)
        except Exception:
            pass
    from mrtr_keys.cli.main import command

    command()  # the Click command, built once here and shared by every fork


def _keeper(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> int:
    """In the keeper: fork the CLI process, report its pid and exit status; return 0 only in the CLI child."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        _become_cli(conn, request, fds)
        return 0
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    pidfd = os.pidfd_open(pid)
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ, "conn")
    sel.register(pidfd, selectors.EVENT_READ, "child")
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.data == "child":
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                try:
                    conn.sendall(f"exit {code}\n".encode())
                finally:
                    os._exit(0)
            data = conn.recv(4096)
            if not data:  # the caller went away (killed, timed out): so does its command
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                sel.unregister(conn)
                continue
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.startswith(b"signal "):
                    try:
                        os.kill(pid, int(line.split()[1]))
                    except ProcessLookupError:
                        pass


def _become_cli(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the CLI child: take the caller's streams, environment, directory and umask."""
    conn.close()
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
        sys.stderr.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    import importlib

    module = importlib.import_module(request.get("module", "mrtr_keys.cli.main"))
    sys.argv = [str(module.__file__), *request["args"]]  # as `python -m MODULE ARGS` sets it
    global _MODULE
    _MODULE = module.__name__


def leave(code: int) -> NoReturn:
    """What interpreter exit does after joining threads (every exit handler once, the standard streams
    flushed), then `os._exit` with `code`: without tearing down every imported module, which takes 0.5 to
    1.5 s of CPU in a heap holding the MCP SDK, FastAPI and boto3. For a process whose work is done: a CLI
    child here, an xdist worker (tests/conftest.py)."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream has nothing left to flush
            pass
    os._exit(code)


def serve(path: str) -> None:
    """Listen on the Unix socket `path`; fork a keeper per connection. Only CLI children return."""
    _preload()
    if threading.active_count() != 1:  # forking a threaded process is unsafe: refuse, callers fall back
        sys.exit(f"zygote: {threading.active_count()} threads after imports")
    import gc

    gc.freeze()  # the imported heap stays shared with every fork: no collection touches (copies) its pages
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are reaped by the kernel
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    parent = os.getppid()
    listener.settimeout(1.0)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test worker is gone (even killed): so is its zygote
                os._exit(0)
            continue
        conn.settimeout(None)
        try:
            head, fds, _, _ = socket.recv_fds(conn, _LEN.size, 3)
            (size,) = _LEN.unpack(head)
            body = b""
            while len(body) < size:
                chunk = conn.recv(size - len(body))
                if not chunk:
                    break
                body += chunk
            request = json.loads(body)
        except Exception:
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            if _keeper(conn, request, fds) == 0:
                return  # the CLI child unwinds to __main__ and runs the command there
        conn.close()
        for fd in fds:
            os.close(fd)


# --- the caller (test side) --------------------------------------------------------------------------------


class Zygote:
    """One zygote process per test worker, started on first use and stopped at exit."""

    _lock = threading.Lock()
    _instance: Zygote | None = None
    _failed = False

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / f"zygote-{os.getpid()}.sock")
        self.env = _python_env(dict(os.environ))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", self.path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("zygote did not start")

    @classmethod
    def get(cls) -> Zygote | None:
        if os.environ.get("MRTR_KEYS_TEST_NO_ZYGOTE"):  # every call a new subprocess, as before the zygote
            return None
        with cls._lock:
            if cls._instance is None and not cls._failed:
                import atexit
                import tempfile

                try:
                    cls._instance = cls(Path(tempfile.mkdtemp(prefix="mrtr-zygote-")))
                    atexit.register(cls._instance.stop)
                except Exception:
                    cls._failed = True
            return cls._instance

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        try:
            os.unlink(self.path)
            os.rmdir(os.path.dirname(self.path))
        except OSError:
            pass

    def run(
        self, args: list[str], env: dict[str, str], timeout: float, cwd: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run `mrtr-keys ARGS` like ``subprocess.run(..., capture_output=True, text=True, timeout=...)``.

        Raises `subprocess.TimeoutExpired` (after killing the command) as ``subprocess.run`` does.
        """
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        umask = os.umask(0o022)
        os.umask(umask)
        body = json.dumps({"args": args, "env": env, "cwd": cwd or os.getcwd(), "umask": umask}).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            socket.send_fds(conn, [_LEN.pack(len(body))], [0, out_w, err_w])
            conn.sendall(body)
        finally:
            os.close(out_w)
            os.close(err_w)
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        replies = b""
        code: int | None = None
        deadline = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        sel.register(out_r, selectors.EVENT_READ)
        sel.register(err_r, selectors.EVENT_READ)
        sel.register(conn, selectors.EVENT_READ)
        try:
            while len(sel.get_map()) > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    conn.close()  # the keeper kills the command
                    raise subprocess.TimeoutExpired(["mrtr-keys", *args], timeout)
                for key, _ in sel.select(left):
                    fd = key.fd
                    if key.fileobj is conn:
                        data = conn.recv(4096)
                        if not data:
                            sel.unregister(conn)
                            continue
                        replies += data
                        for line in replies.split(b"\n")[:-1]:
                            if line.startswith(b"exit "):
                                code = int(line.split()[1])
                        continue
                    data = os.read(fd, 65536)
                    if data:
                        chunks[fd].append(data)
                    else:
                        sel.unregister(fd)
        finally:
            sel.close()
            os.close(out_r)
            os.close(err_r)
            conn.close()
        if code is None:
            raise RuntimeError("zygote: the command's keeper went away without an exit status")
        out = b"".join(chunks[out_r]).decode(errors="replace")
        err = b"".join(chunks[err_r]).decode(errors="replace")
        return subprocess.CompletedProcess(["mrtr-keys", *args], code, out, err)


class ZygoteProcess:
    """What `popen` returns: the part of `subprocess.Popen` the tests use (pid, poll, wait, signals).

    `pid` is the real process (signals, SIGSTOP and the pid in audit instance names all reach it); its exit
    status comes from its keeper over the connection.
    """

    def __init__(self, args: list[str], conn: socket.socket, pid: int) -> None:
        self.args, self._conn, self.pid = args, conn, pid
        self.returncode: int | None = None
        self.stdout = self.stderr = self.stdin = None
        self._replies = b""

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        self._conn.settimeout(timeout)
        try:
            data = self._conn.recv(4096)
        except (TimeoutError, BlockingIOError):
            return
        if not data:  # the keeper is gone without a status: treat as killed
            self.returncode = -signal.SIGKILL
            self._conn.close()
            return
        self._replies += data
        for line in self._replies.split(b"\n")[:-1]:
            if line.startswith(b"exit "):
                self.returncode = int(line.split()[1])
                self._conn.close()

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> ZygoteProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()


def popen(
    argv: list[str], *, stdout: Any, stderr: Any = None, env: dict[str, str] | None = None, cwd: Any = None
) -> ZygoteProcess | None:
    """``subprocess.Popen(argv, stdout=..., stderr=..., env=..., cwd=...)`` for ``[sys.executable, "-m",
    MODULE, *ARGS]`` with MODULE one of ours, forked from the zygote; None when the caller must use
    `subprocess.Popen` (another program, pipes asked for, ``PYTHON*`` variables that differ, no zygote).
    `stdout` is a file object or descriptor; `stderr` one too, or `subprocess.STDOUT`."""
    full_env = dict(os.environ if env is None else env)
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m" or not argv[2].startswith("mrtr_keys."):
        return None
    if not (hasattr(stdout, "fileno") or isinstance(stdout, int)) or stdout in (subprocess.PIPE, subprocess.DEVNULL):
        return None
    zygote = Zygote.get()
    if zygote is None or _python_env(full_env) != zygote.env:
        return None
    out = stdout if isinstance(stdout, int) else stdout.fileno()
    if stderr == subprocess.STDOUT or stderr is None:
        err = out if stderr == subprocess.STDOUT else 2
    elif isinstance(stderr, int) and stderr >= 0:
        err = stderr
    elif hasattr(stderr, "fileno"):
        err = stderr.fileno()
    else:
        return None
    umask = os.umask(0o022)
    os.umask(umask)
    request = {
        "module": argv[2],
        "args": argv[3:],
        "env": full_env,
        "cwd": str(cwd or os.getcwd()),
        "umask": umask,
    }
    body = json.dumps(request).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(zygote.path)
    socket.send_fds(conn, [_LEN.pack(len(body))], [0, out, err])
    conn.sendall(body)
    head = b""
    while not head.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise RuntimeError("zygote: no pid for " + " ".join(argv[2:4]))
        head += chunk
    return ZygoteProcess(argv, conn, int(head.split()[1]))


SOCKET_VAR = "TESTS_MRTR_KEYS_ZYGOTE"
"""Where a shim (`shim_dir`) finds this worker's zygote (not ``MRTR_KEYS_*``: doc tests drop those)."""


def call(path: str, args: list[str]) -> int:
    """From a shim process: run `mrtr-keys ARGS` on the zygote at `path` with this process's streams,
    environment, directory and umask; forward SIGTERM/SIGINT/SIGHUP; return the command's exit code (a
    command killed by a signal kills this process with the same signal, as the shell expects)."""
    umask = os.umask(0o022)
    os.umask(umask)
    env = dict(os.environ)
    body = json.dumps({"args": args, "env": env, "cwd": os.getcwd(), "umask": umask}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)

    def forward(sig: int, _frame: object) -> None:
        conn.sendall(f"signal {sig}\n".encode())

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    socket.send_fds(conn, [_LEN.pack(len(body))], [0, 1, 2])
    conn.sendall(body)
    replies = b""
    while True:
        data = conn.recv(4096)
        if not data:
            return 1
        replies += data
        for line in replies.split(b"\n")[:-1]:
            if line.startswith(b"exit "):
                code = int(line.split()[1])
                if code < 0:
                    signal.signal(-code, signal.SIG_DFL)
                    os.kill(os.getpid(), -code)
                return code


def shim_dir() -> Path | None:
    """A directory holding a `mrtr-keys` that runs on this worker's zygote (``serve`` runs as a real
    process: its pid and signals matter; so do ``--show-completion`` / ``--install-completion``, which look
    for the shell among the process's parents), for tests that run shell commands; None without a zygote."""
    zygote = Zygote.get()
    if zygote is None:
        return None
    directory = Path(zygote.path).parent / "bin"
    shim = directory / "mrtr-keys"
    if not shim.exists():
        directory.mkdir(exist_ok=True)
        real = Path(sys.executable).with_name("mrtr-keys")
        repo = Path(__file__).resolve().parents[2]
        shim.write_text(
            f"#!{sys.executable} -I\n"
            "import os, sys\n"
            f"path = os.environ.get({SOCKET_VAR!r})\n"
            "args = sys.argv[1:]\n"
            "real = 'serve' in args or any(a.endswith('-completion') for a in args)  # pid, signals, parent shell\n"
            "if not path or real or not os.path.exists(path):\n"
            f"    os.execv({str(real)!r}, [{str(real)!r}, *args])\n"
            f"sys.path.insert(0, {str(repo)!r})\n"
            "from tests.support.zygote import call\n"
            "sys.exit(call(path, args))\n"
        )
        shim.chmod(0o755)
    return directory


def run(
    args: list[str], env: dict[str, str], timeout: float, cwd: str | None = None
) -> subprocess.CompletedProcess[str] | None:
    """`Zygote.run` on this worker's zygote, or None when the caller must start a subprocess instead (no
    zygote, or ``PYTHON*`` variables that differ from the zygote's)."""
    zygote = Zygote.get()
    if zygote is None or _python_env(env) != zygote.env:
        return None
    return zygote.run(args, env, timeout, cwd)


if __name__ == "__main__":
    serve(sys.argv[1])
    # only a CLI child gets here: run the command as `python -m mrtr_keys.cli.main` would
    from mrtr_keys.cli.main import run as cli_run

    code: Any = 0
    try:
        if _MODULE == "mrtr_keys.cli.main":
            cli_run()
        else:
            import runpy

            runpy.run_module(_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        code = 130
    threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as exit does
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    leave(code)
