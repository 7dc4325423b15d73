"""A real audit writer process doing a sidecar's audit work, without the sidecar: the co-location anchor.

With the audit log on, a sidecar worker pays twice on a small machine: its own share (queueing
and shipping each event, in its process) and the writer process's work (fingerprint, chain,
store), which runs on another core, but on the same machine as the sidecar and the load
generator. `StandIn` runs only the second part: a real writer process
(`mrtr_keys.audit.writing.writer.child_writer.ChildWriter`, the sidecar's own) fed ready-made frames of seal
events by a thread of the benchmark process at a fixed rate (events/s), into a fresh SQLite
store. The audit-off sidecar measured beside it shows what the writer's presence alone costs;
the audit-on sidecar against that shows the sidecar's own share.

Each frame gets fresh, increasing event times (the tokens are cycled; cycled times would make the
store's time index insert in the middle instead of appending: about a third more writer CPU an event).
The feeding thread costs this process one `marshal` call per 500 events (under 1 % of a core at
100,000 events/s). If the writer falls behind the rate, the thread waits for the pipe, as the
sidecar's callers would be slowed.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

FRAME = 500
"""Events per frame sent to the writer (the sidecar ships 512 at a time under load)."""
TIME = 5
"""The time column of a frame (`mrtr_keys.audit.capture.items.AuditItem` field order)."""


def seal_items(n: int, directory: Path) -> list[Any]:
    """`n` seal events (distinct real tokens of the benchmark's payload, as the sidecar queues them)."""
    from bench.common import envelope_payload
    from mrtr_keys.audit.capture.items import new_item
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.codecs.local import LocalAESGCMCodec
    from mrtr_keys.keystores.file import FileKeystore

    ring = directory / f"standin-ring-{uuid.uuid4().hex[:8]}" / "keyring.json"
    create_ring(FileKeystore(ring))
    codec = LocalAESGCMCodec(ring, audience="bench")
    payload = envelope_payload()
    now = time.time()
    return [
        new_item(("seal", "ok", "abcd1234", codec.seal(payload), None, now + i * 1e-5, "bench", 1, "bench", 0.02))
        for i in range(n)
    ]


class StandIn:
    """A writer process fed `rate` events/s from `items` (cycled; frames of `FRAME`) until `stop()`."""

    def __init__(self, directory: Path, items: list[Any], rate: float) -> None:
        from mrtr_keys.audit.capture.items import to_columns
        from mrtr_keys.audit.writing.writer.child_writer import ChildWriter

        self.frames = [to_columns(items[i : i + FRAME]) for i in range(0, len(items) - FRAME + 1, FRAME)]
        self.rate = rate
        self.sent = 0
        self.child = ChildWriter(
            f"sqlite://{directory}/standin-{uuid.uuid4().hex[:8]}.db",
            os.urandom(32),
            instance="bench-standin",
            writer="bench-standin",
            on_ack=lambda n: None,
            on_error=lambda message: None,
            on_exit=lambda lost, message: None,
        )
        self.achieved = 0.0
        """Events/s the writer took while fed (below `rate` when it fell behind), set by `stop()`."""
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, name="bench-standin-feed", daemon=True)
        self._thread.start()

    def _feed(self) -> None:
        child, frames, every = self.child, self.frames, FRAME / self.rate
        started = time.monotonic()
        k = 0
        while not self._stop.is_set():
            due = started + k * every
            left = due - time.monotonic()
            if left > 0 and self._stop.wait(left):
                return
            if child.backlogged:
                child.drain(1.0)  # the writer is behind: wait, as the sidecar's callers would
                continue
            columns = frames[k % len(frames)]
            now = time.time()  # fresh, increasing times, as a live sidecar's (the store's time index appends)
            stamped = (*columns[:TIME], tuple(now + j * 1e-6 for j in range(FRAME)), *columns[TIME + 1 :])
            child.send(stamped, FRAME)
            self.sent += FRAME
            k += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.achieved = self.sent / max(1e-9, time.monotonic() - self._started)
        self.child.close(30)
