"""Running one `make bench` part the way a user would (``python -m bench PART --quick``), for smoke tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.fixtures.common import REPO


def run_part(part: str, results_dir: Path, *, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run bench part `part` with tiny counts, results to `results_dir`; asserts it exited 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench", part, "--quick", "--results-dir", str(results_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc
