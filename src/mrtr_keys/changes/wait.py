"""Running a rotation step that waits for its gates: ``mrtr-keys rotate promote|retire|next --wait SECONDS``.

The step is tried; while it is refused as "not yet" (`NotYet`: a gate or the TTL; `KeystoreBusy`:
another run holds the lock), loses a compare-and-swap race (`ConflictError`), or finds the keystore
or the audit store out of reach (`KeystoreUnavailable`, `AuditUnavailable`: "retry later", exit 75), it
is tried again every `poll` seconds (sooner when the refusal says it opens sooner) until it is done or
`wait` seconds have passed; then the last refusal is raised (exit 75). Trying again after an outage is
safe even when a write's answer was lost: a step already made is reported done and writes nothing
(docs/rotation.md, exit codes). ``next`` is resolved once, at the first try that reads the ring, to the
step it means, so one wait never runs two steps: a deploy pipeline is three lines of ``mrtr-keys rotate
next --wait 900``. Clocks are injected, so tests never sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mrtr_keys.changes.apply import ChangeResult
from mrtr_keys.changes.rotation import run_step, status
from mrtr_keys.errors import (
    AuditUnavailable,
    ConfigError,
    ConflictError,
    KeystoreBusy,
    KeystoreUnavailable,
    MrtrKeysError,
    NotYet,
)
from mrtr_keys.keystores import Keystore
from mrtr_keys.ring.model import utcnow

MAX_WAIT = 7 * 86400.0
DEFAULT_POLL = 1.0
"""Seconds between tries while waiting."""

RETRIED = (NotYet, KeystoreBusy, ConflictError, KeystoreUnavailable, AuditUnavailable)
"""What a wait tries again: every refusal that means "not now"."""

OnWait = Callable[[str, MrtrKeysError, float], None]
"""``on_wait(step, refusal, seconds_left)``: called after each refused try (progress display)."""


def run_step_waiting(
    keystore: Keystore,
    step: str,
    *,
    wait: float,
    on_wait: OnWait | None = None,
    poll: float = DEFAULT_POLL,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    **options: Any,
) -> ChangeResult:
    """`run_step(keystore, step, **options)`, retried for up to `wait` seconds (see the module docstring).

    Raises:
        ConfigError: `wait` not a number from 0 to a week.
        NotYet, KeystoreBusy, ConflictError, KeystoreUnavailable, AuditUnavailable: still so when the wait
            ran out.
        Everything else `run_step` raises, at once.
    """
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_WAIT:
        raise ConfigError(f"--wait must be a number of seconds from 0 to {MAX_WAIT:g}")
    deadline = clock() + wait
    resolve = step == "next"
    while True:
        try:
            if resolve:
                step = status(keystore.load(), utcnow()).next_step
                resolve = False
            return run_step(keystore, step, **options)
        except RETRIED as exc:
            left = deadline - clock()
            if left <= 0:
                raise
            if on_wait is not None:
                on_wait(step, exc, left)
            opens_in = getattr(exc, "wait_seconds", None)
            delay = poll if not opens_in else min(poll, max(opens_in, 0.05))
            sleep(min(delay, left))
