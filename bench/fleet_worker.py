"""One fleet instance for the ``fleet`` bench part: ``python -m bench.fleet_worker KEYSTORE NAME [HOLD]``.

Opens `mrtr_keys.request_state_security(KEYSTORE, audience="bench", instance=NAME)` with every default
(watcher every 2 s with jitter, heartbeat every 10 s, audit store beside the ring) and prints ``ready``. With
HOLD (seconds) it also keeps rounds in flight as an MCP server does (`bench.fleet_revoke`): every 0.1 s it
seals a token and opens it HOLD seconds later, counting rounds opened and refused. When its stdin closes it
prints its counters as one JSON line (``checks``, ``reads``, ``seconds``, ``opened``, ``refused``) and exits.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from typing import Any

import mrtr_keys

PACE = 0.1
"""Seconds between two rounds begun by one worker."""


def _rounds(codec: Any, hold: float, stop: threading.Event, counts: dict[str, int]) -> None:
    """Seal one token every `PACE` s; open each `hold` s later (a refusal counts as refused)."""
    from mcp.server.mcpserver import InvalidRequestState

    pending: collections.deque[tuple[float, str]] = collections.deque()
    while not stop.is_set():
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, token = pending.popleft()
            try:
                codec.unseal(token)
                counts["opened"] += 1
            except InvalidRequestState:
                counts["refused"] += 1
        pending.append((now + hold, codec.seal(b"round")))
        stop.wait(PACE)


def main() -> int:
    keystore, name = sys.argv[1], sys.argv[2]
    hold = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    security = mrtr_keys.request_state_security(keystore, audience="bench", instance=name)
    watcher = security.codec.watcher  # type: ignore[attr-defined]
    counts = {"opened": 0, "refused": 0}
    stop = threading.Event()
    traffic = threading.Thread(target=_rounds, args=(security.codec, hold, stop, counts), daemon=True)
    if hold > 0:
        traffic.start()
    started = time.monotonic()
    print("ready", flush=True)
    sys.stdin.read()  # until the bench closes our stdin
    stop.set()
    seconds = time.monotonic() - started
    doc = {"checks": watcher.checks, "reads": watcher.reads, "seconds": seconds, **counts}
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
