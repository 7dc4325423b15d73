"""The TypeScript package's own tests (``npm run build:test``, then ``node --test``: the type check and the
unit tests against a real ``mrtr-keys serve``), run as one test so `make test` runs them beside the Python
suite; ``make ts-test`` runs the same thing on its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.typescript.stack import NODE, TS_DIR, ensure_built


def test_the_node_test_suite_passes() -> None:
    ensure_built()  # npm ci from the lockfile when node_modules is missing; tsc type-checks while it builds
    tests = sorted(str(p.relative_to(TS_DIR)) for p in (TS_DIR / "build" / "test").glob("*.test.js"))
    assert tests, "no compiled node tests under clients/typescript/build/test"
    cli = Path(sys.executable).with_name("mrtr-keys")
    proc = subprocess.run(
        [str(NODE), "--test", "--test-reporter=tap", *tests],
        cwd=TS_DIR,
        env={**os.environ, "MRTR_KEYS_CLI": str(cli)},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout, proc.stdout[-2000:]
