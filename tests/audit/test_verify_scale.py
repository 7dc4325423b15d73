"""`audit verify` at scale without a large machine: the peak RSS of the CLI verifying a genuine log of
200 000 events is that of one of 20 000 (within 20 %), and where memory runs out (a too-wide query
under an address-space limit) the CLI says so in one line instead of ``internal error``.

The logs are built once per session by the writer's own row builder and chain (`bench.audit_log`).
The 1 M / 5 M figures are in the benchmark (``python -m bench audit_scale``), not here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench.audit_log import fill

from tests.docs.doc_blocks import REPO

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key

SMALL, LARGE = 10_000, 100_000


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory, fleet_key_file: Path) -> Iterator[dict[int, str]]:
    root = tmp_path_factory.mktemp("audit-scale")
    urls = {}
    for n in (SMALL, LARGE):
        urls[n] = f"sqlite://{root}/audit-{n}.db"
        fill(urls[n], n, audit_key=fleet_key_file.read_bytes())
    yield urls


def _run(*args: str, limit_mb: int | None = None) -> tuple[int, str, str, int]:
    """Run the CLI in a child process: (exit code, stdout, stderr, peak RSS in KiB, from wait4)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRTR_KEYS_") or k == "MRTR_KEYS_AUDIT_KEY_FILE"}
    code = (
        "import resource, sys\n"
        "from mrtr_keys.cli.main import run\n"
        f"limit = {limit_mb!r}\n"
        "if limit:\n"
        "    size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (size + limit * 2**20, resource.RLIM_INFINITY))\n"
        "sys.argv = ['mrtr-keys', *sys.argv[1:]]\n"
        "run()\n"
    )
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=out, stderr=err, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS (not the worker's other children)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read().decode(), err.read().decode(), usage.ru_maxrss


def _verify_rss(url: str, tmp: Path) -> tuple[dict[str, object], int]:
    code, out, err, rss = _run("audit", "verify", "--audit", url, "--checkpoints", str(tmp / "none.jsonl"), "--json")
    assert code == 0, err
    return json.loads(out), rss


def test_verify_memory_does_not_grow_with_the_log(logs: dict[int, str], tmp_path: Path) -> None:
    small, small_rss = _verify_rss(logs[SMALL], tmp_path)
    large, large_rss = _verify_rss(logs[LARGE], tmp_path)
    assert small["ok"] and small["records"] == SMALL
    assert large["ok"] and large["records"] == LARGE
    print(f"verify peak RSS: {SMALL} events {small_rss} KiB, {LARGE} events {large_rss} KiB")
    assert large_rss <= small_rss * 1.2, (small_rss, large_rss)


def test_out_of_memory_is_one_line_and_verify_and_a_streamed_query_fit(logs: dict[int, str]) -> None:
    # the newest N (--limit) are collected to be printed oldest first: asking for all of them does not fit
    code, out, err, _ = _run("audit", "query", "--json", "--limit", str(LARGE), "--audit", logs[LARGE], limit_mb=100)
    assert code == 1 and out == ""
    assert err.startswith("mrtr-keys: out of memory:") and len(err.strip().splitlines()) == 1, err
    assert "internal error" not in err
    code, out, err, _ = _run(
        "audit", "verify", "--json", "--audit", logs[LARGE], "--checkpoints", "/nonexistent/cp", limit_mb=100
    )
    assert code == 0, err
    assert json.loads(out)["records"] == LARGE
    # without --limit, query streams: every event printed under the same cap
    code, out, err, _ = _run("audit", "query", "--json", "--audit", logs[LARGE], limit_mb=100)
    assert code == 0, err
    assert len(json.loads(out)) == LARGE
