"""Waiting in tests for what a user would see: `until` polls a condition against a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(check: Callable[[], object], seconds: float = 10.0, what: str = "", *, every: float = 0.02) -> float:
    """Poll `check()` every `every` seconds until it is true; returns the seconds that took.

    Raises:
        AssertionError: not true within `seconds` (the message names `what`, when given).
    """
    started = time.monotonic()
    while not check():
        waited = time.monotonic() - started
        assert waited < seconds, f"{what or 'the condition'} not within {seconds:g} s"
        time.sleep(every)
    return time.monotonic() - started
