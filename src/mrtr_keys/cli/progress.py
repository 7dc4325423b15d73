"""The live progress line of ``rotate ... --wait``: instances ready N of M, the TTL countdown, time left.

On a terminal it is one line redrawn in place (rich, on stderr, cleared at the end); in a pipeline's
log it is a plain stderr line whenever what it waits for changes, and every `QUIET_SECONDS` otherwise.
With ``--log-format json`` / ``MRTR_KEYS_LOG_FORMAT=json`` (as the Kubernetes CronJob sets) each such line
is one JSON object instead, in the log format's fields (`mrtr_keys.logs.JsonFormatter`: time, level,
logger, message, pid) plus ``step`` and ``seconds_left``, and never a redrawn line.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from mrtr_keys.errors import MrtrKeysError

if TYPE_CHECKING:
    from mrtr_keys.audit.writing.stores.base import AuditStore
    from mrtr_keys.keystores import Keystore

QUIET_SECONDS = 15.0


class WaitProgress:
    """`update` is the ``on_wait`` of `mrtr_keys.changes.wait.run_step_waiting`."""

    def __init__(self, keystore: Keystore, *, window: float | None = None) -> None:
        from rich.console import Console

        from mrtr_keys.audit.writing.stores.url import existing_store
        from mrtr_keys.cli.options import root_audit, root_log_format

        self._json = root_log_format() == "json"
        self._keystore = keystore
        self._window = window
        self._store: AuditStore | None = existing_store(keystore, audit=root_audit())
        self._console = Console(stderr=True)
        self._live: Any = None
        self._last_key: str | None = None
        self._last_print = 0.0

    def __enter__(self) -> WaitProgress:
        if self._console.is_terminal and not self._json:
            from rich.live import Live

            self._live = Live("", console=self._console, transient=True, auto_refresh=False)
            self._live.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)
        if self._store is not None:
            self._store.close()

    def line(self, step: str, refusal: MrtrKeysError, left: float) -> tuple[str, str]:
        """(what it waits for, the countdown part) for one refused try."""
        from mrtr_keys.fleet.gates import SEALING, TTL, evaluate
        from mrtr_keys.ring.model import utcnow

        try:
            report = evaluate(self._store, self._keystore.load(), utcnow(), window=self._window)
        except Exception:  # the display must never end the wait; show the refusal instead
            return f"waiting to {step}: {' '.join(str(refusal).split())[:160]}", f"{math.ceil(left)} s left"
        parts = [f"waiting to {step}: instances ready {report.ready} of {len(report.live)}"]
        lagging = [r.name for r in report.lagging]
        if lagging:
            parts[0] += f" (not yet: {', '.join(lagging[:5])}{', ...' if len(lagging) > 5 else ''})"
        counts = [f"{w.what} {math.ceil(w.seconds)} s" for w in report.waits if w.seconds is not None]
        parts += [w.what for w in report.waits if w.what in (TTL, SEALING)]
        if not report.blocking() and not any(w.what == TTL for w in report.waits):
            parts.append(type(refusal).__name__)  # the lock, or a lost race: tried again
        return "; ".join(parts), "; ".join([*counts, f"{math.ceil(left)} s left"])

    def update(self, step: str, refusal: MrtrKeysError, left: float) -> None:
        what, countdown = self.line(step, refusal, left)
        text = f"{what}; {countdown}"
        if self._live is not None:
            self._live.update(text, refresh=True)
            return
        now = time.monotonic()
        if what != self._last_key or now - self._last_print >= QUIET_SECONDS:
            self._last_key, self._last_print = what, now
            sys.stderr.write((_json_line(step, text, left) if self._json else f"mrtr-keys: {text}") + "\n")
            sys.stderr.flush()


def _json_line(step: str, text: str, left: float) -> str:
    """One progress line as a JSON object, in the fields of `mrtr_keys.logs.JsonFormatter`."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    doc = {
        "time": stamp,
        "level": "INFO",
        "logger": "mrtr_keys.cli.wait",
        "message": text,
        "pid": os.getpid(),
        "step": step,
        "seconds_left": round(left, 3),
    }
    return json.dumps(doc, ensure_ascii=False)
