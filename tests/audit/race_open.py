"""Run as a script: PAIRS pairs of forked processes open one fresh key ring each, at the same instant.

``python tests/audit/race_open.py ROOT PAIRS BATCH``: creates ROOT/pairN/keyring.json (no audit key, no
audit database yet), then, BATCH pairs at a time, forks two processes per ring that wait on one pipe
and, once released together, build the codec with its default audit store (creating ``audit.key`` and
``audit.db`` and recording ``ring-loaded``). Prints one line per failure and ``failures N``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mrtr_keys.audit.capture.observer
import mrtr_keys.audit.writing.stores.sqlite  # noqa: F401 - imported once here, not in each forked process
from mrtr_keys import request_state_security
from mrtr_keys.changes.create import create_ring
from mrtr_keys.keystores.file import FileKeystore


def _child(ring: Path, go: int, report: int) -> None:
    os.read(go, 1)  # released with every other process of the batch
    try:
        codec = request_state_security(ring, audience="svc").codec
        token = codec.seal(b"x")
        assert codec.unseal(token) == b"x"
        code = 0
    except BaseException as exc:  # report any failure to start
        os.write(report, f"{ring.parent.name}: {type(exc).__name__}: {exc}\n".encode())
        code = 1
    os._exit(code)


def main() -> int:
    root, pairs, batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    os.environ["MRTR_KEYS_AUDIT_WRITER"] = "thread"  # the events of interest are written at start
    rings = []
    for i in range(pairs):
        ring = root / f"pair{i}" / "keyring.json"
        create_ring(FileKeystore(ring))
        rings.append(ring)
    report_r, report_w = os.pipe()
    failures = 0
    for start in range(0, pairs, batch):
        go_r, go_w = os.pipe()
        pids = []
        for ring in rings[start : start + batch]:
            for _ in range(2):
                pid = os.fork()
                if pid == 0:
                    os.close(go_w)
                    _child(ring, go_r, report_w)
                pids.append(pid)
        os.close(go_r)
        os.write(go_w, b"g" * len(pids))
        os.close(go_w)
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            failures += os.waitstatus_to_exitcode(status) != 0
    os.close(report_w)
    with os.fdopen(report_r) as f:
        sys.stdout.write(f.read())
    print(f"failures {failures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
