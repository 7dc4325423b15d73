"""Log lines an unauthenticated flood can trigger, at a bounded rate.

A client sending bad tokens as fast as it can must not turn the server log into the bottleneck or bury
everything else: `RateLimitedLog` lets at most `burst` lines through per `interval` seconds and, at the
first line of the next interval, writes one summary line with how many were suppressed. The metrics and
the audit log still count every event; only the log lines are thinned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """At most `burst` lines per `interval` seconds to `logger` at `level`, then one summary line.

    Args:
        logger: where lines go.
        what: names the lines in the summary (``"rejected-unseal"``).
        burst: lines let through per interval (>= 1).
        interval: seconds (> 0).
        level: logging level of the lines and the summary.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        burst: int = 20,
        interval: float = 1.0,
        level: int = logging.INFO,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or not interval > 0:
            raise ValueError("burst must be >= 1 and interval > 0")
        self.logger = logger
        self.what = what
        self.burst = burst
        self.interval = interval
        self.level = level
        self._clock = clock
        self._lock = threading.Lock()
        self._window = -float("inf")
        self._sent = 0
        self._suppressed = 0

    def __call__(self, msg: str, *args: object) -> None:
        """Log ``msg % args`` unless this interval's `burst` is used up (then count it as suppressed)."""
        if not self.logger.isEnabledFor(self.level):
            return
        with self._lock:
            now = self._clock()
            suppressed = 0
            if now - self._window >= self.interval:
                suppressed, self._suppressed = self._suppressed, 0
                self._window, self._sent = now, 0
            allowed = self._sent < self.burst
            if allowed:
                self._sent += 1
            else:
                self._suppressed += 1
        if suppressed:
            self.logger.log(self.level, "%d more %s log lines suppressed (rate limit)", suppressed, self.what)
        if allowed:
            self.logger.log(self.level, msg, *args)
