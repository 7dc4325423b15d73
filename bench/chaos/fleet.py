"""The chaos fleet: real processes on one OpenBao KV v2 key ring, each dependency link behind its own fault proxy.

Each `Member` is one instance process, a library MCP server (`bench.chaos.mcp_server`: the example's
``provision`` tool, `mrtr_keys.request_state_security` single-use in Redis) or a sidecar (``mrtr-keys
serve --replay-store``), named ``mcp-N`` / ``sc-N``. Each reaches the keystore, the audit store
(PostgreSQL: presence and audit events) and the replay store (Redis) through three `CountingProxy`s of its
own (`Member.links`), so the nemesis can cut one instance's link or every instance's; the rotator has its
own keystore and audit links. A member can be killed (SIGKILL) and started again with the same command on
the same port, paused and resumed; `Member.lives` records each process with its pid (audit events name
their process as ``host:pid:start``) and how it ended.

The fleet's state directory (client registry, audit key, lock files) is a 4 MiB tmpfs when this process
may mount one (``disk_full`` then fills it), else a plain directory and ``disk_full`` is not available.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tests.fixtures.faults import through
from tests.support import zygote
from tests.support.net import IN_USE, free_port, stop_process
from tests.support.proxy import CountingProxy

REPO = Path(__file__).resolve().parents[2]
AUDIENCE = "provisioner"
HEARTBEAT = 2.0
"""Seconds between presence heartbeats (stale after 3 of them; the self-fencing lease is as long)."""
RELOAD = 1.0
"""Seconds between keystore checks of every instance."""
LINKS = ("keystore", "audit", "replay")


@dataclass(frozen=True)
class Deps:
    """Where the real services are (the proxies forward to them)."""

    vault_addr: str
    vault_token: str
    pg_url: str
    redis_url: str

    def port(self, dependency: str) -> int:
        url = {"keystore": self.vault_addr, "audit": self.pg_url, "replay": self.redis_url}[dependency]
        default = {"keystore": 8200, "audit": 5432, "replay": 6379}[dependency]
        return urlparse(url).port or default


@dataclass
class Life:
    """One process of a member: its pid, when it started and ended (POSIX times), and how it ended."""

    pid: int
    started: float
    ended: float | None = None
    how: str | None = None
    """``killed`` (the nemesis), ``stopped`` (the end of the run) or ``exited N`` (by itself: a violation)."""


@dataclass
class Member:
    """One instance process of the fleet (see the module docstring)."""

    name: str
    kind: str
    """``mcp`` or ``sidecar``."""
    argv: list[str]
    env: dict[str, str]
    port: int
    log_dir: Path
    links: dict[str, CountingProxy]
    proc: Any = None
    lives: list[Life] = field(default_factory=list)
    paused: bool = False
    killed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def url(self) -> str:
        base = f"http://127.0.0.1:{self.port}"
        return base + "/mcp" if self.kind == "mcp" else base

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else int(self.proc.pid)

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ready(self) -> bool:
        path = "/chaos/status" if self.kind == "mcp" else "/healthz"
        try:
            with urllib.request.urlopen(self.base + path, timeout=1.0) as resp:
                return int(resp.status) == 200
        except OSError:
            return False


def _popen(argv: list[str], env: dict[str, str], log: Path) -> Any:
    with log.open("ab") as out:
        return zygote.popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO) or subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
        )


def start(member: Member, timeout: float = 60.0) -> None:
    """Start `member`'s command (again after a kill) and wait until it serves; a taken port means a new port.

    Raises:
        RuntimeError: it exited before serving (its log's tail is in the message).
        TimeoutError: it did not serve within `timeout` seconds.
    """
    for _ in range(5):
        mark = member.log.stat().st_size if member.log.exists() else 0
        proc = _popen(member.argv, member.env, member.log)
        member.proc = proc
        life = Life(int(proc.pid), time.time())
        member.lives.append(life)
        deadline = time.monotonic() + timeout
        while not member.ready():
            if proc.poll() is not None:
                life.ended, life.how = time.time(), f"exited {proc.returncode} at start"
                tail = member.output()[mark:]
                if IN_USE in tail.lower():
                    old, new = str(member.port), str(free_port())
                    member.argv = [new if a == old else a for a in member.argv]
                    member.port = int(new)
                    break
                raise RuntimeError(f"{member.name} exited with {proc.returncode}: {tail[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{member.name} not serving after {timeout} s: {member.output()[mark:][-3000:]}")
            time.sleep(0.05)
        else:
            member.killed = member.paused = False
            return
    raise RuntimeError(f"{member.name}: no free port in 5 tries")


def supervise(member: Member, deadline: float = 180.0) -> int:
    """Start `member` again and again, as a supervisor would (1 s, 2 s, 4 s apart, then every 5 s), until it
    serves; the failed starts (an instance exits when it cannot load its ring, e.g. the keystore is down).

    Raises:
        TimeoutError: it did not serve within `deadline` seconds.
    """
    failed = 0
    ends = time.monotonic() + deadline
    while True:
        try:
            start(member)
            return failed
        except (RuntimeError, TimeoutError):
            failed += 1
            if time.monotonic() > ends:
                raise TimeoutError(f"{member.name} did not start in {deadline:g} s ({failed} tries)") from None
            time.sleep(min(5.0, 2.0 ** (failed - 1)))


def kill(member: Member) -> None:
    """SIGKILL `member` (resumed first if paused, so it dies at once) and record its life's end."""
    with member.lock:
        proc = member.proc
        if proc is None or member.killed:
            return
        member.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        if member.paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            member.paused = False
        proc.wait(30)
        member.lives[-1].ended, member.lives[-1].how = time.time(), "killed"


def pause(member: Member) -> bool:
    """SIGSTOP `member`; False if it is not running."""
    with member.lock:
        if member.proc is None or member.killed or member.paused or member.proc.poll() is not None:
            return False
        os.kill(member.proc.pid, signal.SIGSTOP)
        member.paused = True
        return True


def resume(member: Member) -> None:
    with member.lock:
        if member.paused and member.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(member.proc.pid, signal.SIGCONT)
        member.paused = False


def stop(member: Member) -> None:
    """End `member` cleanly (SIGTERM: it flushes its audit events and writes ``stopped``)."""
    resume(member)
    with member.lock:
        proc = member.proc
        if proc is None or member.killed or proc.poll() is not None:
            return
        stop_process(proc, timeout=30)
        member.lives[-1].ended, member.lives[-1].how = time.time(), "stopped"
        member.killed = True


def children(pid: int) -> list[int]:
    """The direct children of `pid` (from /proc; a child started from a thread is listed under it)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def writer_pid(member: Member) -> int | None:
    """The pid of `member`'s audit writer process (``mrtr_keys.audit.writing.writer.child``), or None."""
    if member.pid is None or member.killed:
        return None
    for child in children(member.pid):
        with contextlib.suppress(OSError):
            if b"mrtr_keys.audit.writing.writer" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
    return None


class Links:
    """The fault proxies of every link, by (dependency, owner); owner is a member name or ``rotator``."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.proxies: dict[tuple[str, str], CountingProxy] = {}

    def make(self, owner: str) -> dict[str, CountingProxy]:
        made = {d: CountingProxy(self.deps.port(d), http=d == "keystore") for d in LINKS}
        for d, p in made.items():
            self.proxies[(d, owner)] = p
        return made

    def of(self, dependency: str, target: str) -> list[CountingProxy]:
        """The proxies a fault on `dependency` of `target` (a member, or ``all``) acts on."""
        return [p for (d, owner), p in self.proxies.items() if d == dependency and target in ("all", owner)]

    def heal(self) -> None:
        for p in self.proxies.values():
            p.faults.stop_flapping()
            p.faults.restore()
            p.start()

    def close(self) -> None:
        for p in self.proxies.values():
            p.close()


def link_env(deps: Deps, links: dict[str, CountingProxy], state_dir: Path) -> dict[str, str]:
    """The environment of a process whose keystore and audit store are reached through `links`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MRTR_KEYS_", "VAULT_", "BAO_"))}
    vault = links["keystore"].url
    env.update(
        VAULT_ADDR=vault,
        BAO_ADDR=vault,
        VAULT_TOKEN=deps.vault_token,
        BAO_TOKEN=deps.vault_token,
        MRTR_KEYS_AUDIT=through(deps.pg_url, links["audit"]),
        MRTR_KEYS_STATE_DIR=str(state_dir),
        PYTHONUNBUFFERED="1",
    )
    return env


def member(
    kind: str,
    name: str,
    ring: str,
    deps: Deps,
    links: dict[str, CountingProxy],
    state: Path,
    logs: Path,
    *,
    ttl: float,
    anchors: tuple[Path, float],
) -> Member:
    """An instance on a free port, not started: a library MCP server (`kind` ``mcp``: `bench.chaos.mcp_server`,
    rounds valid `ttl` s) or a sidecar (``sidecar``: ``mrtr-keys serve``), single-use for every round, checking
    the keystore every `RELOAD` s, beating every `HEARTBEAT` s, its audit heads anchored to the directory
    `anchors[0]` every `anchors[1]` s."""
    port = free_port()
    env = link_env(deps, links, state)
    replay = through(deps.redis_url, links["replay"])
    if kind == "mcp":
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        argv = [sys.executable, "-m", "bench.chaos.mcp_server", "--keystore", ring, "--audience", AUDIENCE]
        argv += ["--port", str(port), "--instance", name, "--ttl", f"{ttl:g}", "--reload-every", str(RELOAD)]
        argv += ["--heartbeat-every", str(HEARTBEAT), "--single-use", replay]
    else:
        env["MRTR_KEYS_REPLAY_STORE"] = replay
        argv = [sys.executable, "-m", "mrtr_keys.cli.main", "serve", "--keystore", ring, "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--instance", name, "--heartbeat-interval", str(HEARTBEAT)]
        argv += ["--reload-interval", str(RELOAD), "--on-replay-store-error", "deny"]
    argv += ["--audit-anchor", str(anchors[0]), "--audit-anchor-every", f"{anchors[1]:g}"]
    return Member(name, kind, argv, env, port, logs, links)


def mount_state_dir(path: Path, size: str = "4m") -> bool:
    """Mount a tmpfs of `size` at `path` (True), or leave it a plain directory (False: not permitted here)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def unmount_state_dir(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


FILLER = ".chaos-disk-full"


def fill_disk(state: Path) -> int:
    """Write zeros to a file in `state` until the file system is full; the bytes written."""
    written = 0
    chunk = b"\0" * 65536
    with open(state / FILLER, "wb", buffering=0) as out:
        while True:
            try:
                written += out.write(chunk)
            except OSError:
                break
        with contextlib.suppress(OSError):
            while out.write(b"\0"):
                written += 1
    return written


def free_disk(state: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (state / FILLER).unlink()


def break_anchors(anchors: Path) -> None:
    """The anchor destination fails: the directory moves aside and a file takes its place (ENOTDIR even for
    root, whom no permission stops)."""
    if anchors.is_dir() and not anchors.with_name(anchors.name + ".aside").exists():
        anchors.rename(anchors.with_name(anchors.name + ".aside"))
        anchors.write_text("not a directory: the chaos nemesis broke this anchor destination\n")


def mend_anchors(anchors: Path) -> None:
    aside = anchors.with_name(anchors.name + ".aside")
    if aside.is_dir():
        with contextlib.suppress(FileNotFoundError):
            anchors.unlink()
        aside.rename(anchors)
