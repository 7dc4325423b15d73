"""Every command block in README.md and docs/*.md runs as written (issue 16, deliverable 4).

The blocks and their directives come from `tests.docs.doc_blocks` (its docstring has the
conventions). One test a page: its ``sh`` blocks run in order in a fresh directory, each must exit
0 (or the code its ``exit=N`` directive names); services a page names are started by the usual
fixtures (OpenBao dev server, moto, the local PostgreSQL with a throwaway database).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.docs.doc_blocks import REPO, Page, pages
from tests.support import zygote
from tests.support.net import IN_USE, free_port

pytestmark = pytest.mark.e2e

PAGES = [p for p in pages() if p.runnable or any(b.directives.get("run-by") for b in p.blocks)]
BLOCK_TIMEOUT = 120.0


def _services_env(page: Page, request: pytest.FixtureRequest, stack: ExitStack) -> dict[str, str]:
    env: dict[str, str] = {}
    wanted = [s for s in page.directives.get("services", "").split(",") if s]
    for service in wanted:
        if service == "openbao":  # a server of its own, with nothing enabled yet: the page sets it up
            from tests.fixtures.openbao import _bao_dev_server

            bao = stack.enter_context(_bao_dev_server())
            bao.api("DELETE", "sys/mounts/transit")
            env.update(bao.env())
            env.update({"VAULT_ADDR": bao.addr, "VAULT_TOKEN": bao.token})
        elif service == "moto":  # two KMS keys in the region the pages use
            import boto3

            from tests.fixtures.moto_kms import aws_env

            env.update(aws_env(request.getfixturevalue("moto_server")))
            env["AWS_REGION"] = env["AWS_DEFAULT_REGION"] = "eu-west-1"
            kms = boto3.client("kms", **_boto_kwargs(env))
            for name in ("KMS_KEY_ARN", "NEW_KMS_KEY_ARN"):
                meta = kms.create_key(KeyUsage="ENCRYPT_DECRYPT", KeySpec="SYMMETRIC_DEFAULT")["KeyMetadata"]
                env[name] = meta["Arn"]
        elif service == "postgres":
            env["PG_URL"] = request.getfixturevalue("postgres_url")
        else:
            raise AssertionError(f"{page.path.name}: unknown service {service!r} in a doc-test directive")
    return env


def _boto_kwargs(env: dict[str, str]) -> dict[str, str]:
    return {
        "endpoint_url": env["AWS_ENDPOINT_URL"],
        "region_name": env["AWS_REGION"],
        "aws_access_key_id": env.get("AWS_ACCESS_KEY_ID", "testing"),
        "aws_secret_access_key": env.get("AWS_SECRET_ACCESS_KEY", "testing"),
    }


def _base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MRTR_KEYS_", "PYTEST_", "BAO_", "VAULT_"))}
    venv_bin = REPO / ".venv" / "bin"
    env["PATH"] = f"{venv_bin}:{env.get('PATH', '/usr/bin:/bin')}"
    shims = zygote.shim_dir()  # `mrtr-keys` forked from a pre-imported interpreter (tests/support/zygote.py)
    if shims is not None:
        env["PATH"] = f"{shims}:{env['PATH']}"
        env[zygote.SOCKET_VAR] = zygote.Zygote.get().path  # type: ignore[union-attr]
    env["HOME"] = str(home)
    env["VIRTUAL_ENV"] = str(REPO / ".venv")
    return env


def _check_run_by(where: str, paths: str, page: Path, commands: str = "") -> None:
    """Blocks another test runs as written: each test file named exists, and one of them reads this
    page, or together they hold every command of the block."""
    texts = []
    for name in paths.split(","):
        target = REPO / name
        assert target.exists(), f"{where}: run-by {name} does not exist"
        texts.append(target.read_text())
    if any(str(page.relative_to(REPO)) in t for t in texts):
        return
    for line in commands.splitlines():
        command = line.split("#", 1)[0].strip()
        if not command:
            continue
        make = re.fullmatch(r"make (\S+)", command)
        if make and "Makefile" in paths.split(","):  # a make target: defined in the Makefile that runs it
            assert re.search(rf"^{re.escape(make.group(1))}:", texts[paths.split(",").index("Makefile")], re.M), where
            continue
        assert any(command in t for t in texts), f"{where}: {command!r} is in none of {paths}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.path.relative_to(REPO)) for p in PAGES])
def test_every_command_block_runs(page: Page, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if "page-run-by" in page.directives:  # a page another test runs block by block
        _check_run_by(str(page.path.relative_to(REPO)), page.directives["page-run-by"], page.path)
        return
    stack = ExitStack()
    request.addfinalizer(stack.close)
    env = {**_base_env(tmp_path), **_services_env(page, request, stack)}
    for attempt in range(4):  # a port taken meanwhile (busy host): the page again, on other ports
        try:
            _run_page(page, tmp_path / f"attempt{attempt}", env)
            return
        except PortTaken:
            continue
    raise AssertionError(f"{page.path.name}: every port tried was taken")


class PortTaken(Exception):
    """A server a block started found its port taken (not the page's fault)."""


def _run_page(page: Page, root: Path, env: dict[str, str]) -> None:
    work = root / "work"
    work.mkdir(parents=True)
    if "no-ring" not in page.directives:
        init = subprocess.run(["mrtr-keys", "init"], cwd=work, env=env, capture_output=True, text=True, check=False)
        assert init.returncode == 0, init.stderr
    ports = {p: str(free_port()) for p in page.directives.get("ports", "").split(",") if p}
    groups: list[int] = []
    try:
        for n, block in enumerate(page.blocks):
            if block.directives.get("run-by"):
                _check_run_by(block.where, block.directives["run-by"], page.path, block.text)
                continue
            if block.lang not in ("sh", "shell", "bash"):
                continue
            text = block.text
            for old, new in ports.items():
                text = re.sub(rf"\b{old}\b", new, text)
            out, err = root / f"block{n}.out", root / f"block{n}.err"
            cwd = work
            if "fresh" in block.directives:  # this block starts from an empty directory (no ring)
                cwd = root / f"fresh{n}"
                cwd.mkdir()
            with out.open("w") as o, err.open("w") as e:
                proc = subprocess.Popen(
                    ["bash", "-euo", "pipefail", "-c", text],
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=o,
                    stderr=e,
                    start_new_session=True,
                )
            groups.append(proc.pid)
            try:
                code = proc.wait(timeout=BLOCK_TIMEOUT)
            except subprocess.TimeoutExpired:
                code = -1
            expected = int(block.directives.get("exit") or 0)
            if code != expected and ports and _port_taken(root):
                raise PortTaken
            assert code == expected, (
                f"{block.where}: exit {code}, expected {expected}\n--- block\n{text}--- stdout\n"
                f"{out.read_text()[-3000:]}--- stderr\n{err.read_text()[-3000:]}"
            )
    finally:
        _stop(groups)


def _port_taken(root: Path) -> bool:
    """True if any output of the page (block output, logs the blocks wrote) says a port was in use."""
    for f in root.rglob("*"):
        if f.is_file() and f.stat().st_size < 1_000_000 and IN_USE in f.read_text(errors="replace").lower():
            return True
    return False


def _stop(groups: list[int]) -> None:
    """Stop every process a page left running (its `&` commands), TERM first, then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
                alive.append(pgid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_group_alive(g) for g in alive):
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
