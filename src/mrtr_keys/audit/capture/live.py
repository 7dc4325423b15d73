"""Every audit sink of this process: flushed and closed at interpreter exit, renewed in a forked child."""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from typing import Any

logger = logging.getLogger("mrtr_keys.audit")

sinks: weakref.WeakSet[Any] = weakref.WeakSet()
"""The live `mrtr_keys.audit.capture.sink.AuditSink` objects (each adds itself)."""


def close_all() -> None:
    """Flush and close every sink of this process (registered with `atexit`)."""
    for sink in list(sinks):
        try:
            sink.close(timeout=5.0)
        except Exception:  # at exit: log and carry on closing the others
            logger.exception("closing audit sink")


def _after_fork() -> None:
    for sink in list(sinks):
        if not sink._closed:
            sink.after_fork_in_child()


atexit.register(close_all)
os.register_at_fork(after_in_child=_after_fork)
