"""The fault modes of `tests.support.proxy.CountingProxy` beyond a clean outage (`stop` / `start`).

A dependency rarely just goes away. What production sees, and what these modes play, is the half
failure (issue 22):

* **blackhole** (`Faults.blackhole`): connections stay open, new ones are accepted, nothing is
  forwarded either way: the client's bytes are taken by the kernel and never answered, as behind a
  dropped route or a hung server. A connection made during a blackhole reaches the target only once it
  ends. `restore` lets the held bytes through again (as TCP retransmission
  would), so a client that gave up sees its old connection's late answer.
* **latency** (`Faults.latency`): every chunk waits this many seconds before it is forwarded.
* **throttle** (`Faults.throttle`): a slow link, not a slow answer: every chunk waits its length divided by a
  rate in bytes a second, so a short exchange passes in time and a large upload does not.
* **reset after N bytes** (`Faults.reset_after`): once a marker has gone up (say PostgreSQL's
  ``COMMIT``), N more bytes go down and then the connection is reset: the server applied the
  command and the client never hears so.
* **flap** (`Faults.flap`): a thread that cuts (`stop`) and restores (`start`) the proxy on a
  schedule.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class _Outage(Protocol):
    def stop(self) -> None: ...
    def start(self) -> None: ...


class Faults:
    """The fault state one proxy consults before forwarding each chunk (`gate`)."""

    def __init__(self, proxy: _Outage) -> None:
        self._proxy = proxy
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()
        self.delay = 0.0
        self.rate = 0.0
        self._armed: tuple[bytes, int] | None = None
        self._resetting: dict[int, int] = {}
        self.resets = 0
        """Connections reset by `reset_after` so far."""
        self.flaps = 0
        """Cut/restore cycles `flap` completed so far."""
        self._flapper: threading.Thread | None = None
        self._stop_flapping = threading.Event()

    # ------------------------------------------------------------------ modes

    def blackhole(self) -> None:
        """Forward nothing, on open and new connections alike, until `restore`."""
        self._open.clear()

    def restore(self) -> None:
        """End a blackhole, latency, throttle and any armed reset (held bytes go through now)."""
        with self._lock:
            self.delay = self.rate = 0.0
            self._armed = None
        self._open.set()

    @property
    def blackholed(self) -> bool:
        return not self._open.is_set()

    def wait_open(self) -> None:
        """Block (without polling) while blackholed."""
        self._open.wait()

    def latency(self, seconds: float) -> None:
        """Hold every forwarded chunk `seconds` first (0 ends it)."""
        self.delay = float(seconds)

    def throttle(self, bytes_per_second: float) -> None:
        """Pass at most about `bytes_per_second` on each connection and direction (every chunk waits
        ``len(chunk) / bytes_per_second`` s before it is forwarded; 0 ends it)."""
        self.rate = float(bytes_per_second)

    def reset_after(self, nbytes: int, *, after: bytes = b"") -> None:
        """Once: after `after` has gone up a connection (at once if empty), forward `nbytes` more bytes
        down it, then reset it (both sides closed, the rest dropped)."""
        with self._lock:
            self._armed = (after, nbytes)

    def flap(self, times: int, *, down: float, up: float) -> threading.Thread:
        """Cut (`stop`) for `down` s and restore (`start`) for `up` s, `times` times, in a thread
        (returned; `flaps` counts the cycles done). `stop_flapping` ends it early."""

        def run() -> None:
            for _ in range(times):
                self._proxy.stop()
                if self._stop_flapping.wait(down):
                    break
                self._proxy.start()
                self.flaps += 1
                if self._stop_flapping.wait(up):
                    break
            self._proxy.start()

        self._stop_flapping.clear()
        self._flapper = threading.Thread(target=run, name="proxy-flap", daemon=True)
        self._flapper.start()
        return self._flapper

    def stop_flapping(self) -> None:
        self._stop_flapping.set()
        if self._flapper is not None:
            self._flapper.join(10)

    # ------------------------------------------------------------------ the proxy's hook

    def gate(self, direction: str, conn: int, data: bytes) -> bytes | None:
        """What to forward of `data` going `direction` (``"up"``/``"down"``) on connection `conn`;
        None: reset the connection now. Blocks while blackholed or delayed."""
        self._open.wait()  # blocks without polling: a blackhole holding hundreds of connections costs no CPU
        if self.delay:
            time.sleep(self.delay)
            self._open.wait()
        if rate := self.rate:
            time.sleep(len(data) / rate)
        if self._armed is None and not self._resetting:
            return data
        with self._lock:
            if direction == "up" and self._armed is not None:
                marker, nbytes = self._armed
                if not marker or marker in data:
                    self._armed = None
                    self._resetting[conn] = nbytes
            elif direction == "down" and conn in self._resetting:
                left = self._resetting[conn]
                if len(data) <= left:
                    self._resetting[conn] = left - len(data)
                    return data
                del self._resetting[conn]
                self.resets += 1
                return None
        return data
