"""docs/quickstart.md, run as written: `mrtr-keys init`, the 3-line snippet, the example server, the client."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import InputRequiredResult

from tests.e2e.servers import ServerPool, first_round
from tests.fixtures.common import REPO
from tests.support.net import free_port, refused_port

QUICKSTART = (REPO / "docs" / "quickstart.md").read_text()
INIT = "mrtr-keys init"
SERVE = "python -m mrtr_keys.example --keystore .mrtr/keyring.json --audience provisioner --port {port}"
CALL = "python -m mrtr_keys.example.client http://127.0.0.1:{port}/mcp --name orders --region eu-west-1"


def _argv(command: str, port: int) -> list[str]:
    """The doc's command line as this venv runs it (``python`` and ``mrtr-keys`` from the same venv)."""
    words = shlex.split(command.format(port=port))
    head = {"python": [sys.executable], "mrtr-keys": [str(Path(sys.executable).parent / "mrtr-keys")]}[words[0]]
    return head + words[1:]


def test_the_quickstart_shows_the_commands_this_test_runs() -> None:
    for command in (INIT, SERVE, CALL):
        assert command.format(port=8000) in QUICKSTART


def test_the_three_line_snippet_builds_a_server_that_seals_with_the_ring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert subprocess.run(_argv(INIT, 0), capture_output=True, check=False).returncode == 0
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", QUICKSTART, re.S) if "request_state_security" in b)
    namespace: dict[str, object] = {}
    exec(snippet, namespace)
    mcp = namespace["mcp"]
    assert isinstance(mcp, MCPServer)

    @mcp.tool(name="provision")
    async def provision(name: str, ctx: Context) -> str | InputRequiredResult:
        return InputRequiredResult(input_requests={}, request_state="asked")

    assert (anyio.run(first_round, mcp).request_state or "").startswith("mk2.")


def test_init_then_the_example_server_then_the_client(tmp_path: Path, example_servers: ServerPool) -> None:
    init = subprocess.run(_argv(INIT, 0), cwd=tmp_path, capture_output=True, text=True, check=False)
    assert init.returncode == 0, init.stderr
    assert "primary key:" in init.stdout
    assert (tmp_path / ".mrtr" / "keyring.json").stat().st_mode & 0o777 == 0o600

    port = free_port()
    server = example_servers.spawn(_argv(SERVE, port), port=port, instance="quickstart", cwd=tmp_path)
    example_servers.wait_ready()
    port = server.port  # another one if that port was taken meanwhile
    banner = server.output()
    assert f"URL:          http://127.0.0.1:{port}/mcp" in banner
    assert CALL.format(port=port) in banner  # it prints how to call it

    call = subprocess.run(_argv(CALL, port), capture_output=True, text=True, check=False, timeout=60)
    assert call.returncode == 0, call.stderr
    assert call.stdout == "Provisioned 'orders' in eu-west-1.\n"


@pytest.mark.parametrize(
    ("ring_audiences", "args", "message"),
    [
        (None, ["--audience", "provisioner"], "no key ring at"),
        (["billing"], ["--audience", "payments"], "add it with: mrtr-keys audience add payments"),
        ([], ["--audience", "provisioner", "--ttl", "9000"], "longer than the key ring's TTL"),
    ],
)
def test_the_example_server_refuses_a_bad_configuration_in_one_line_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    ring_audiences: list[str] | None,
    args: list[str],
    message: str,
) -> None:
    # In-process `main` (what `python -m mrtr_keys.example` runs): it fails before serving anything. It would
    # harden this test worker (RLIMIT_CORE 0 for every process it starts after): allowed, it leaves it as it is.
    from mrtr_keys.example.__main__ import main

    monkeypatch.setenv("MRTR_KEYS_ALLOW_CORE_DUMPS", "1")

    ring = tmp_path / "keyring.json"
    if ring_audiences is not None:
        from mrtr_keys.changes.create import create_ring
        from mrtr_keys.keystores.file import FileKeystore

        create_ring(FileKeystore(ring), audiences=ring_audiences)
    with refused_port() as port:
        code = main(["--keystore", str(ring), "--port", str(port), *args])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m mrtr_keys.example: error: ")
    assert message in lines[0]
