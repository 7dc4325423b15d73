"""Key-holding processes that cannot be read (issue 39, item 5): the sidecar and its audit writer child.

Threat: another process of the sidecar's user (where the host allows ptrace between one user's processes: no
Yama restriction, as on these machines) attaches a debugger or reads ``/proc/PID/mem`` / ``environ`` of the
sidecar or of its writer child and takes the ring keys or the audit key; or a crash writes them to a core
file. `mrtr_keys.hardening` makes both processes non-dumpable and sets ``RLIMIT_CORE`` to 0 at start.

Root passes every one of these checks, and the tests run as root here, so the sidecar runs as a user of its
own (uid `UID`, no other process), started with ``RLIMIT_CORE`` unlimited, and the attacker is another process
of that same user (`PROBE`). ``--allow-core-dumps`` is the control: the same probe then reads the sidecar's
environment and memory (the ring's primary key is found in it), attaches with ptrace, and SIGABRT dumps core.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mrtr_keys.changes.create import create_ring
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.service.clients import add_client
from tests.support.net import stop_process
from tests.support.waiting import until

UID = GID = 48739
"""The sidecar's user and group: not root, and no other process on the host runs as it."""

AS_USER = (
    "import os, resource, sys\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
    "os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1]))\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n"
)
"""Run ``argv[3:]`` as uid ``argv[1]`` / gid ``argv[2]`` with core dumps unlimited (set while still root,
so even a hard limit of 0 inherited from this test worker is lifted)."""

PROBE = r"""
import ctypes, errno, json, sys

def attempt(fn, *args):
    try:
        return fn(*args)
    except OSError as exc:
        return "refused: " + errno.errorcode.get(exc.errno, str(exc.errno))

def environ(pid, needle):
    with open(f"/proc/{pid}/environ", "rb") as f:
        return f"read {len(f.read())} bytes"

def memory(pid, needle):
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:  # opening it is the kernel's ptrace check
        total, found = 0, False
        for line in open(f"/proc/{pid}/maps"):
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if not perms.startswith("rw") or end - start > 1 << 28:
                continue
            try:
                mem.seek(start)
                chunk = mem.read(end - start)
            except OSError:
                continue
            total += len(chunk)
            found = found or (bool(needle) and bytes.fromhex(needle) in chunk)
    return f"read {total} bytes" + (", found the key" if found else "")

def ptrace(pid, needle):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    if libc.ptrace(0x4206, pid, None, None) != 0:  # PTRACE_SEIZE: no stop; detached when this process exits
        raise OSError(ctypes.get_errno(), "ptrace")
    return "attached"

targets = json.loads(sys.argv[1])
print(json.dumps({name: {check.__name__: attempt(check, pid, needle) for check in (environ, memory, ptrace)}
                  for name, (pid, needle) in targets.items()}))
"""
"""The attacker: another process of the same user, trying each way in on each target (name -> pid, key hex)."""


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A directory the sidecar's user owns (not under pytest's tmp_path, whose root is 0700 for root)."""
    path = Path(tempfile.mkdtemp(prefix="mrtr-harden-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _as_user(*argv: str) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", AS_USER, str(UID), str(GID), *argv]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _writer_of(pid: int) -> int | None:
    for child in _children(pid):
        try:
            if b"mrtr_keys.audit.writing.writer.child" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except FileNotFoundError:
            continue
    return None


def _core_limit(pid: int) -> str:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max core file size"):
            return " ".join(line.split()[4:6])
    raise AssertionError("no core limit")


def _cores(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("core"))


@pytest.mark.parametrize("allow", [False, True], ids=["hardened", "allow-core-dumps"])
def test_another_process_of_the_same_user_cannot_read_the_sidecar_or_its_writer(workdir: Path, allow: bool) -> None:
    ring = workdir / "keyring.json"
    create_ring(FileKeystore(ring))
    key = FileKeystore(ring).load().primary.material
    assert key is not None
    _, secret = add_client(workdir / "clients.json", "app", audiences=["app"])
    for path in (workdir, *workdir.iterdir()):
        os.chown(path, UID, GID)
    sock = workdir / "sidecar.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRTR_KEYS_")}
    env["HOME"] = str(workdir)
    argv = [sys.executable, "-m", "mrtr_keys.cli.main", "serve", "--keystore", str(ring), "--uds", str(sock)]
    argv += ["--allow-core-dumps"] if allow else []
    with open(workdir / "sidecar.log", "w") as log:
        proc: subprocess.Popen[Any] = subprocess.Popen(
            _as_user(*argv), cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        client = httpx.Client(
            base_url="http://sidecar",
            transport=httpx.HTTPTransport(uds=str(sock)),
            timeout=10,
            headers={"authorization": f"Bearer {secret}"},
        )

        def ready() -> bool:
            assert proc.poll() is None, (workdir / "sidecar.log").read_text()
            try:
                return client.get("/healthz").status_code == 200
            except httpx.HTTPError:
                return False

        until(ready, 60, "the sidecar's /healthz")
        token = client.post("/v1/seal", json={"audience": "app", "payload": "aGk"}).json()["token"]
        assert client.post("/v1/unseal", json={"audience": "app", "token": token}).json()["payload"] == "aGk"
        until(lambda: _writer_of(proc.pid) is not None, 30, "the audit writer child")
        writer = _writer_of(proc.pid)
        assert writer is not None
        for pid in (proc.pid, writer):
            assert f"Uid:\t{UID}\t" in Path(f"/proc/{pid}/status").read_text()  # the user's, not root's
            assert _core_limit(pid) == ("unlimited unlimited" if allow else "0 0")

        audit_key = (workdir / "audit.key").read_bytes()
        targets = {"sidecar": (proc.pid, key.hex()), "writer": (writer, audit_key.hex())}
        probe = subprocess.run(
            _as_user(sys.executable, "-I", "-S", "-c", PROBE, json.dumps(targets)),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            env=env,
        )
        seen = json.loads(probe.stdout)
        print(json.dumps(seen, indent=1))  # the closing note's figures (pytest -s)
        if allow:
            assert seen["sidecar"]["environ"].startswith("read ")
            assert seen["sidecar"]["memory"].endswith(", found the key"), seen
            assert seen["writer"]["environ"].startswith("read ")
            assert seen["writer"]["memory"].endswith(", found the key"), seen
            assert seen["sidecar"]["ptrace"] == seen["writer"]["ptrace"] == "attached"
        else:
            for name in ("sidecar", "writer"):
                assert seen[name] == {
                    "environ": "refused: EACCES",
                    "memory": "refused: EACCES",
                    "ptrace": "refused: EPERM",
                }, name

        said = (workdir / "sidecar.log").read_text()  # the start says which it is
        assert ("WARNING mrtr_keys.service: core dumps allowed (--allow-core-dumps)" in said) == allow, said
        assert ("process hardened)" in said) == (not allow), said

        # SIGABRT: the writer child (the sidecar reaps it), then the sidecar (this test reaps it)
        in_cwd = (
            "/" not in (pattern := Path("/proc/sys/kernel/core_pattern").read_text().strip()) and pattern[:1] != "|"
        )
        os.kill(writer, signal.SIGABRT)
        until(lambda: writer not in _children(proc.pid), 30, "the writer child reaped")
        if in_cwd:  # core(5): a pattern without "/" names a file in the process's directory
            assert bool(_cores(workdir)) == allow, _cores(workdir)
        os.kill(proc.pid, signal.SIGABRT)
        _, status = os.waitpid(proc.pid, 0)
        proc.returncode = -signal.SIGABRT
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT
        assert os.WCOREDUMP(status) == allow
    finally:
        if proc.returncode is None:
            stop_process(proc)


def test_the_library_call_hardens_the_process_it_runs_in(workdir: Path) -> None:
    """``mrtr_keys.harden_process()``, as an MCP server holding a library codec calls it (the example server
    does, before it opens its ring): the same user's probe is refused."""
    os.chown(workdir, UID, GID)
    key = os.urandom(32)
    server = (
        "import sys, time, mrtr_keys\n"
        "h = mrtr_keys.harden_process()\n"
        "key = bytes.fromhex(sys.stdin.readline())\n"
        "print(h.hardened, h.note, flush=True)\n"
        "sys.stdin.readline()\n"
    )
    proc = subprocess.Popen(
        _as_user(sys.executable, "-c", server), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=workdir
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(key.hex() + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "True process hardened: not dumpable, no core file\n"
        probe = subprocess.run(
            _as_user(sys.executable, "-I", "-S", "-c", PROBE, json.dumps({"server": (proc.pid, key.hex())})),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        assert json.loads(probe.stdout)["server"] == {
            "environ": "refused: EACCES",
            "memory": "refused: EACCES",
            "ptrace": "refused: EPERM",
        }
    finally:
        proc.stdin.close()
        proc.wait(30)
