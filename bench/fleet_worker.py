"""One fleet instance for the ``fleet`` bench part: ``python -m bench.fleet_worker KEYSTORE NAME``.

Opens `mrtr_keys.request_state_security(KEYSTORE, audience="bench", instance=NAME)` with every default
(watcher every 2 s with jitter, heartbeat every 10 s, audit store beside the ring), prints ``ready``,
and serves nothing else. When its stdin closes it prints its watcher's counters as one JSON line
(``checks``, ``reads``, ``seconds``) and exits.
"""

from __future__ import annotations

import json
import sys
import time

import mrtr_keys


def main() -> int:
    keystore, name = sys.argv[1], sys.argv[2]
    security = mrtr_keys.request_state_security(keystore, audience="bench", instance=name)
    watcher = security.codec.watcher  # type: ignore[attr-defined]
    started = time.monotonic()
    print("ready", flush=True)
    sys.stdin.read()  # until the bench closes our stdin
    seconds = time.monotonic() - started
    print(json.dumps({"checks": watcher.checks, "reads": watcher.reads, "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
