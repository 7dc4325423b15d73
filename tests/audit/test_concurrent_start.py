"""Any number of instances can start at once on a fresh key ring.

A fleet rolled out at once opens one fresh ring from many processes: one used to create ``audit.key``
and write it later while another read it empty, or two switched a new ``audit.db`` to WAL together
and one failed with "database is locked" (5 of 200 pairs failed to start). Now the key is created
atomically and a busy database at start is waited for.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HARNESS = Path(__file__).with_name("race_open.py")


def test_200_pairs_of_processes_opening_one_fresh_ring_at_the_same_instant_all_start(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, str(HARNESS), str(tmp_path), "200", "50"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines()[-1] == "failures 0", res.stdout[-2000:]
    keys = {p.read_bytes() for p in tmp_path.glob("pair*/audit.key")}
    assert len(keys) == 200 and all(len(k) == 32 for k in keys)
    assert not list(tmp_path.glob("pair*/.audit.key.*"))  # no temporary file left behind
