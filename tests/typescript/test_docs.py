"""docs/typescript.md runs as written (its ``page-run-by`` names this file): the package is built from a copy
of clients/typescript and packed, a fresh npm project installs the tarball and the SDK, the page's
``server.ts`` and ``client.ts`` are compiled, one round runs through a real sidecar, and the audit log
shows the server's seal and unseal under its client name."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.docs.doc_blocks import REPO, parse_page
from tests.support.net import IN_USE, free_port
from tests.typescript.stack import TS_DIR

pytestmark = pytest.mark.e2e
PAGE = REPO / "docs" / "typescript.md"
SOURCE_BLOCK = re.compile(r"^```ts (?P<name>[\w.-]+)\n(?P<text>.*?)^```$", re.M | re.S)


def _env(home: Path, checkout: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MRTR_KEYS_", "MRTR_TS_", "PYTEST_"))}
    env["PATH"] = f"{REPO / '.venv' / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    env["npm_config_cache"] = env.get("npm_config_cache", str(Path.home() / ".npm"))  # the machine's npm cache,
    env["npm_config_prefer_offline"] = "true"  # used without asking the registry again for what it holds
    env.update({"HOME": str(home), "CHECKOUT": str(checkout), "VIRTUAL_ENV": str(REPO / ".venv")})
    return env


def _copy_package(checkout: Path) -> None:
    """The package as a checkout has it (tracked files only: no node_modules, dist or build)."""
    target = checkout / "clients" / "typescript"
    for name in ("package.json", "package-lock.json", "tsconfig.json", "README.md", ".gitignore"):
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(TS_DIR / name, target / name)
    shutil.copytree(TS_DIR / "src", target / "src")


def _stop(groups: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.3)


def _run_page(root: Path, deadline: float) -> list[str]:
    page = parse_page(PAGE)
    work, checkout = root / "work", root / "checkout"
    work.mkdir(parents=True)
    _copy_package(checkout)
    text = PAGE.read_text()
    for m in SOURCE_BLOCK.finditer(text):  # the page's ```ts NAME blocks are the files it compiles
        (work / m.group("name")).write_text(m.group("text"))
    ports = {p: str(free_port()) for p in page.directives.get("ports", "").split(",") if p}
    env = _env(root, checkout)
    outputs: list[str] = []
    groups: list[int] = []
    try:
        for n, block in enumerate(page.runnable):
            script = block.text
            for old, new in ports.items():
                script = re.sub(rf"\b{old}\b", new, script)
            out = root / f"block{n}.out"
            with out.open("w") as o:
                proc = subprocess.Popen(
                    ["bash", "-euo", "pipefail", "-c", script],
                    cwd=work,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=o,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            groups.append(proc.pid)
            try:  # a block that hangs fails here, with its output, before pytest-timeout would stop the test
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = -1
            output = out.read_text()
            if code != 0 and IN_USE in output.lower():
                raise PortTakenError
            assert code == 0, f"{block.where}: exit {code}\n--- block\n{script}--- output\n{output[-4000:]}"
            outputs.append(output)
    finally:
        _stop(groups)
    return outputs


class PortTakenError(Exception):
    """A server the page started found its port taken meanwhile (not the page's fault)."""


PAGE_SECONDS = 240.0
"""How long the page's blocks may take in all (about 20 s on this machine, nearly all of it npm)."""


@pytest.mark.timeout(PAGE_SECONDS + 60)
def test_the_typescript_page_runs_as_written(tmp_path: Path) -> None:
    deadline = time.monotonic() + PAGE_SECONDS
    for attempt in range(3):
        try:
            outputs = _run_page(tmp_path / f"attempt{attempt}", deadline)
            break
        except PortTakenError:
            continue
    else:
        raise AssertionError("every port tried was taken")
    last = outputs[-1]
    assert "Provisioned 'orders' in eu-west-1." in last
    assert re.search(r"\bseal\b.*\bok\b", last) and re.search(r"\bunseal\b.*\bok\b", last), last[-3000:]
    assert "orders-ts" in last
