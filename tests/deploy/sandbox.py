"""Running a deploy file's command as the container or unit would, without a container runtime.

`Image` reads the Dockerfile's final stage (ENV, WORKDIR, USER, ENTRYPOINT, CMD, HEALTHCHECK).
`Sandbox` is a throwaway root: container paths (``/etc/mrtr-keys``, ``/var/lib/mrtr-keys``, ...) map
to directories under it; the image's ``/opt/mrtr-keys/bin`` maps to this checkout's ``.venv/bin``. A
process runs as uid/gid 10001 (the image's user) with the ring directory owned by root and read-only
to it, so the only place it can write is the state directory (and the system's /tmp, which the test
checks it left alone).

The image's ``/opt/mrtr-keys`` is a virtual environment made here from the system's
``/usr/bin/python3.11`` (readable by any user, as the image's Python is), which adds this checkout's
installed packages to its path; ``/opt/mrtr-keys/bin/mrtr-keys`` is the project's console script. The
project's own ``.venv`` cannot serve directly: its interpreter lives under a directory uid 10001
cannot enter. Listen addresses are loopback and ports free ones, as ``docker run -e`` would
override them; nothing else in the command or environment is changed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
UID = GID = 10001
VENV = REPO / ".venv"
SYSTEM_PYTHON = Path("/usr/bin/python3.11")
PREFIXES = (
    "/opt/mrtr-keys",
    "/etc/mrtr",
    "/etc/systemd",
    "/var/lib/mrtr-keys",
    "/var/lib/mrtr-anchors",
    "/run/mrtr",
    "/clients",
    "/var/run/secrets",
)


@dataclass
class Image:
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def _exec_form(args: str) -> list[str]:
    if args.startswith("["):
        value = json.loads(args)
        assert isinstance(value, list)
        return [str(v) for v in value]
    return ["/bin/sh", "-c", args]


def stages(path: Path = REPO / "Dockerfile") -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """The ARGs declared before the first FROM (name -> default) and each stage's instructions, FROM first."""
    args: dict[str, str] = {}
    out: list[list[tuple[str, str]]] = []
    for word, rest in _instructions(path.read_text()):
        if word == "FROM":
            out.append([])
        if out:
            out[-1].append((word, rest))
        elif word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args, out


def read_image(path: Path = REPO / "Dockerfile") -> Image:
    """The final stage of a Dockerfile as the container runtime would start it."""
    stages: list[Image] = []
    for word, args in _instructions(path.read_text()):
        if word == "FROM":
            stages.append(Image())
            continue
        if not stages:  # an ARG before the first FROM (a build argument, not the container's)
            continue
        img = stages[-1]
        if word == "ENV":
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                img.env[key] = value
        elif word == "WORKDIR":
            img.workdir = args
        elif word == "USER":
            img.user = args
        elif word == "ENTRYPOINT":
            img.entrypoint = _exec_form(args)
        elif word == "CMD":
            img.cmd = _exec_form(args)
        elif word == "HEALTHCHECK":
            _, _, command = args.partition("CMD ")
            img.healthcheck = _exec_form(command.strip())
    return stages[-1]


class Sandbox:
    """A root for container paths, and processes run in it as the image's user."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="mrtr-deploy-"))
        self.root.chmod(0o755)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}
        self._install_image_venv()

    def _install_image_venv(self) -> None:
        """``/opt/mrtr-keys`` as the image has it: a venv whose ``bin/`` holds python and mrtr-keys."""
        assert SYSTEM_PYTHON.exists(), f"{SYSTEM_PYTHON} is needed to run as a non-root user"
        opt = self.path("/opt/mrtr-keys")
        subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(opt)], check=True)
        site = next((opt / "lib").glob("python3*/site-packages"))
        ours = next((VENV / "lib").glob("python3*/site-packages"))
        (site / "mrtr-keys-checkout.pth").write_text(f"import site; site.addsitedir({str(ours)!r})\n")
        script = (VENV / "bin" / "mrtr-keys").read_text().splitlines()
        script[0] = f"#!{opt}/bin/python"
        target = opt / "bin" / "mrtr-keys"
        target.write_text("\n".join(script) + "\n")
        target.chmod(0o755)

    def path(self, container_path: str) -> Path:
        """The host directory standing for `container_path`."""
        return self.root / container_path.lstrip("/")

    def make_dir(self, container_path: str, *, writable: bool, mode: int = 0o755) -> Path:
        """Create it (and parents, 0755, root-owned); owned by the image's user if `writable`."""
        p = self.path(container_path)
        p.mkdir(parents=True, exist_ok=True)  # new parents 0755 under the 022 umask
        if writable:
            os.chown(p, UID, GID)
            p.chmod(0o700)
        else:
            p.chmod(mode)
        return p

    def translate(self, value: str) -> str:
        """Container paths in `value` to sandbox paths."""
        for prefix in PREFIXES:
            value = re.sub(rf"(?<![\w/.-]){re.escape(prefix)}", str(self.root) + prefix, value)
        return value

    def environment(self, env: Mapping[str, str]) -> dict[str, str]:
        """`env` translated (PATH too: the image's bin first, then the system's)."""
        out = {k: self.translate(v) for k, v in env.items()}
        out.setdefault("PATH", self.translate("/opt/mrtr-keys/bin") + ":/usr/local/bin:/usr/bin:/bin")
        return out

    def start(self, argv: Sequence[str], env: Mapping[str, str], *, cwd: str, name: str) -> subprocess.Popen[bytes]:
        """Start `argv` (translated) as uid 10001 in the background; output to a log file."""
        log = self.root / f"{name}-{time.monotonic_ns()}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [self.translate(a) for a in argv],
                env=self.environment(env),
                cwd=self.translate(cwd),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **_as_image_user(),
            )
        self.procs.append(proc)
        self.logs[proc.pid] = log
        return proc

    def run(self, argv: Sequence[str], env: Mapping[str, str], *, cwd: str, timeout: float = 120) -> Any:
        """Run `argv` (translated) as uid 10001 to completion; returns the CompletedProcess (text)."""
        return subprocess.run(
            [self.translate(a) for a in argv],
            env=self.environment(env),
            cwd=self.translate(cwd),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **_as_image_user(),
        )

    def output(self, proc: subprocess.Popen[bytes]) -> str:
        return self.logs[proc.pid].read_text(errors="replace")

    def launch(self, start: Any) -> Any:
        """`tests.support.net.launch_on_free_port` for a process this sandbox starts: `start(port)`
        returns the process; a port taken meanwhile means another try on another port."""
        from tests.support.net import launch_on_free_port

        def started(port: int) -> tuple[subprocess.Popen[bytes], Path]:
            proc = start(port)
            return proc, self.logs[proc.pid]

        return launch_on_free_port(started)

    def stop(self) -> None:
        from tests.support.net import stop_process

        for proc in self.procs:
            stop_process(proc)
        subprocess.run(["rm", "-rf", str(self.root)], check=False)


def _as_image_user() -> dict[str, Any]:
    """Popen arguments to drop to uid/gid 10001 (the tests run as root on these machines; a
    non-root runner is already unprivileged and runs as itself)."""
    if os.geteuid() != 0:
        return {}
    return {"user": UID, "group": GID, "extra_groups": []}


def written_outside(box: Sandbox, since: float, places: Sequence[str] = ("/tmp", "/var/tmp")) -> list[str]:
    """Entries directly under `places` owned by uid 10001 and changed after `since`, other than the
    sandbox (should be none: in the container only the state directory is writable)."""
    found: list[str] = []
    for place in places:
        with os.scandir(place) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_uid == UID and st.st_mtime >= since and Path(entry.path) != box.root:
                    found.append(entry.path)
    return found


def wait_http(
    url: str, proc: subprocess.Popen[bytes], box: Sandbox, timeout: float = 60, *, expect_any: bool = False
) -> None:
    """Block until `url` answers 200 (any HTTP answer with `expect_any`); fail with the process's log
    if it exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, box.output(proc)
        try:
            if httpx.get(url, timeout=1).status_code == 200 or expect_any:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer: {box.output(proc)[-3000:]}")
