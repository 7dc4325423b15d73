"""Self-fencing: an instance that may have slept through a rotation looks at the keystore before it serves.

The rotation gates (`mrtr_keys.fleet.gates`) stop counting an instance once its presence heartbeat is
older than `LIVE_INTERVALS` of its intervals (3 by default): a crashed instance must not block rotation
for ever. A *paused* instance (SIGSTOP, a long GC pause, VM live-migration, a laptop lid, a network
partition) looks the same to the gates, but wakes up with the ring it had. Without a fence it serves on
that ring at once: it seals with a kid the rest of the fleet has retired, and meets kids it never saw.

A `Fence` holds a **lease**: the `lease_clock` time at which the last successful keystore check *started*
(`RingWatcher.ok_started`: what that check read is at least that fresh) plus `lease` seconds, by
default the gates' staleness window (`default_lease`: 3 heartbeat intervals, one setting for both).
The clock is monotonic and keeps counting while the process is paused, so a pause uses the lease up.

* `ensure` (before every seal and unseal): while the lease holds, nothing (one clock read). Once it has
  run out, one keystore check (the watcher's own `check`, in a helper thread: one at a time, the others
  wait for its answer), which switches generation if the keystore holds a newer ring; the call proceeds
  once it has answered, or after `wait` seconds (1 by default) if it has not: a keystore client's own
  deadlines are for a CLI run (Vault: 10 s a request and two retries), and the call may be on an MCP
  server's event loop. A check still running then goes on in the background; its success renews the
  lease. If the keystore cannot be reached in time the call is served on the last good ring as before
  (availability during an outage stays), the fence records that
  it served **fenced out** (`fenced_out` calls and `on_served` per call, for a metric; `on_fenced` when it
  starts and stops, which the audit observer turns into the reason `FENCED_OUT` on the ok events of
  those calls; `note()` for presence, which ``fleet status`` shows; a WARNING once per outage) and
  does not block another call on the keystore until `lease` seconds later (the background watcher keeps
  trying meanwhile, and its first success renews the lease).
* `look_again` (an unseal that met a kid the loaded ring does not know): one keystore check, at most one
  in flight and at most one every `look_gap` seconds (1 by default), waited for `wait` seconds at most,
  then the caller retries once if the ring changed: the JWKS pattern. An instance that missed a promote
  opens the new key's tokens after one look; a flood of forged kids costs at most one keystore check a
  second.

A lease of 0 turns the fence off (`ensure` does nothing; `look_again` still works).

Serving fenced out keeps a fleet available through a keystore outage, but such an instance cannot learn
of a change, a revocation included (``mrtr-keys keys revoke``). `max_fenced_out` (seconds; the library's
``max_fenced_out=``, ``serve --max-fenced-out``; off by default) caps it: once the instance has served
fenced out that long, `ensure` raises `FencedOutTooLong` (the codec: `seal` raises it, `unseal` refuses
with the reason `FENCED_OUT_TOO_LONG`; the sidecar answers 503) until a keystore check succeeds again.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mrtr_keys.errors import BackendUnavailable, ConfigError
from mrtr_keys.keystores.watch import WatchedGone, lease_clock

if TYPE_CHECKING:
    from mrtr_keys.keystores.watch import RingWatcher

log = logging.getLogger("mrtr_keys.fence")

LIVE_INTERVALS = 3
"""The gates' staleness window in heartbeat intervals (`mrtr_keys.fleet.instances.LIVE_INTERVALS`, which
cannot be imported from this layer; tests/codecs/test_fence.py checks that the two agree)."""
DEFAULT_LOOK_GAP = 1.0
"""Seconds between two unknown-kid keystore checks of one instance."""
DEFAULT_WAIT = 1.0
"""Seconds a call waits for the fence's keystore check before it is served (fenced out) or refused without it:
the replay store's deadline (docs/single-use.md), well under the sidecar clients' 2 s."""
FENCED_OUT = "fenced-out"
"""The audit reason of a seal or unseal served on the last good ring while fenced out (an ok event)."""
UNKNOWN_KID = "unknown kid"
"""The codecs' reason code for a kid the loaded ring does not hold (`mrtr_keys.codecs.aesgcm`)."""
MAX_LEASE = 86400.0
FENCED_OUT_TOO_LONG = "fenced out too long"
"""The reason code of an unseal refused because the instance served fenced out for `Fence.max_fenced_out`."""


class FencedOutTooLong(BackendUnavailable):
    """The instance has served fenced out (no successful keystore check) for longer than ``max_fenced_out``."""


def default_lease(heartbeat_every: float) -> float:
    """The lease matching the gates' staleness window for an instance beating every `heartbeat_every` s."""
    return LIVE_INTERVALS * heartbeat_every


def check_lease(value: object, what: str = "lease") -> float:
    """`value` as a lease in seconds (0 = off).

    Raises:
        ConfigError: not a finite number from 0 to one day.
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and 0 <= value <= MAX_LEASE):  # type: ignore[operator, arg-type]
        raise ConfigError(f"{what} must be a number of seconds from 0 (off) to {MAX_LEASE:g}")
    return float(value)  # type: ignore[arg-type]


class Fence:
    """The lease and the unknown-kid look of one instance (see the module docstring).

    Args:
        watcher: the instance's `RingWatcher` (started or not: with reload off, `check()` still works).
        lease: seconds a successful keystore check lets the instance serve without another (0 = off).
        look_gap: minimum seconds between two `look_again` checks.
        wait: seconds a call waits for a keystore check (`ensure`, `look_again`) before going on without it.
        on_fenced: optional callable told the reason when the instance starts serving fenced out,
            and None when a check succeeds again.
        on_served: optional callable called once per call served fenced out (a metric's ``inc``).
        loaded_at: `lease_clock` time just before the instance read the ring it started with: the lease
            runs from there until the watcher's first check (None: the first call checks).
        max_fenced_out: seconds the instance may serve fenced out before it refuses (None or 0: no cap).

    Attributes:
        sync_checks: keystore checks `ensure` made. looks: keystore checks `look_again` made.
        fenced_out: calls served on the last good ring after a failed check. error: why the instance is
        fenced out now, else None.

    Raises (constructor):
        ConfigError: a bad `lease`.
    """

    def __init__(
        self,
        watcher: RingWatcher,
        *,
        lease: float,
        look_gap: float = DEFAULT_LOOK_GAP,
        wait: float = DEFAULT_WAIT,
        on_fenced: Callable[[str | None], Any] | None = None,
        loaded_at: float | None = None,
        on_served: Callable[[], Any] | None = None,
        max_fenced_out: float | None = None,
    ) -> None:
        self.watcher = watcher
        self.lease = check_lease(lease)
        self.max_fenced_out = check_lease(max_fenced_out or 0, "max_fenced_out") or None
        self.fenced_since: float | None = None
        """`lease_clock` time at which the instance started serving fenced out (None: it does not)."""
        self.look_gap = look_gap
        self.wait = wait
        self.on_fenced = on_fenced
        self.on_served = on_served
        self.clock = lease_clock
        self._loaded_at = loaded_at
        self.until = -math.inf
        """`lease_clock` time at which the lease runs out (inf when off), as of the last look at the watcher:
        the hot path compares the clock with it (``lease_clock() >= fence.until``), then calls `ensure`."""
        self.sync_checks = 0
        self.looks = 0
        self.fenced_out = 0
        self.error: str | None = None
        self._retry_at = -math.inf
        self._last_look = -math.inf
        self._ensure_lock = threading.Lock()
        self._look_lock = threading.Lock()
        self._check_lock = threading.Lock()
        self._checked: threading.Event | None = None
        """Set when the check in flight (`_check`) ends; None when none was started."""
        self._gone: WatchedGone | None = None
        self._refresh()

    def __repr__(self) -> str:
        return f"Fence(lease={self.lease:g}, fenced_out={self.fenced_out}, error={self.error!r})"

    def _refresh(self) -> None:
        """`until` from the watcher's last successful check (or the first load)."""
        if self.lease == 0:
            self.until = math.inf
            return
        started = self.watcher.ok_started
        if started is None:
            started = self._loaded_at
        self.until = -math.inf if started is None else started + self.lease

    def expired(self) -> bool:
        """True when the lease is on and has run out."""
        self._refresh()
        return self.clock() >= self.until

    def ensure(self) -> None:
        """Before serving: if the lease ran out, check the keystore now (see the module docstring).

        Blocks for at most `wait` seconds (the keystore check, or the one already in flight), plus the time
        another caller holds the fence for the same. Raises `WatchedGone` if the watched codec is gone, and
        `FencedOutTooLong` once the instance has served fenced out for `max_fenced_out` seconds; a keystore
        failure otherwise never raises (the call is then served fenced out).
        """
        if not self.expired():
            if self.error is not None:  # the background watcher renewed the lease
                self._renewed()
            return
        with self._ensure_lock:
            if not self.expired():
                self._renewed()
                return
            if self.error is None or self.clock() >= self._retry_at:
                self.sync_checks += 1
                answered = self._check()
                if not self.expired():
                    self._renewed()
                    return
                self._retry_at = self.clock() + self.lease
                late = f"the keystore check did not answer within {self.wait:g} s"
                self._fenced((self.watcher.error or "the keystore check did not succeed") if answered else late)
            since = self.fenced_since
            if self.max_fenced_out is not None and since is not None and self.clock() - since >= self.max_fenced_out:
                raise FencedOutTooLong(
                    f"refusing to serve: fenced out for {self.clock() - since:.0f} s (max_fenced_out "
                    f"{self.max_fenced_out:g} s) without a successful keystore check ({self.error})"
                )
            self.fenced_out += 1
            if self.on_served is not None:
                self.on_served()

    def look_again(self, seen: object, current: Callable[[], object]) -> bool:
        """After an unknown kid: check the keystore (rate-limited) and say whether to retry.

        Args:
            seen: what `current()` returned when the unseal that met the unknown kid started (a generation).
            current: returns the loaded ring's identity now.

        Returns:
            True if the loaded ring changed since `seen` (by this look or another thread's check).
        """
        with self._look_lock:  # at most one in flight; the others wait for its answer
            if current() != seen:
                return True
            now = self.clock()
            if now - self._last_look < self.look_gap:
                return False
            self._last_look = now
            self.looks += 1
            if self._check() and self.watcher.error is None and not self.expired():
                self._renewed()
            self._refresh()
            return current() != seen

    def _check(self) -> bool:
        """The watcher's `check` in a helper thread (the one in flight, if any), waited for `wait` seconds;
        True if it ended by then. Raises `WatchedGone` if the check found the watched codec gone."""
        with self._check_lock:
            done = self._checked
            if done is None or done.is_set():
                done = self._checked = threading.Event()
                threading.Thread(
                    target=self._run_check, args=(done,), name="mrtr-keys-fence-check", daemon=True
                ).start()
        answered = done.wait(self.wait)
        if answered and self._gone is not None:
            raise self._gone
        return answered

    def _run_check(self, done: threading.Event) -> None:
        try:
            self.watcher.check()
        except WatchedGone as exc:
            self._gone = exc
        except Exception:  # the watcher's check never raises otherwise; a helper thread must not die loudly
            log.exception("fence keystore check")
        finally:
            done.set()

    def may_look(self) -> bool:
        """False while `look_again` would be refused by its rate limit (a cheap test before a thread hop)."""
        return self.clock() - self._last_look >= self.look_gap

    def note(self) -> str | None:
        """A presence note while fenced out (``fleet status``), else None."""
        if self.error is not None and not self.expired():
            self._renewed()
        if self.error is None:
            return None
        since = self.fenced_since
        if self.max_fenced_out is not None and since is not None and self.clock() - since >= self.max_fenced_out:
            return (
                f"fenced out for {self.clock() - since:.0f} s, over max_fenced_out {self.max_fenced_out:g} s: "
                f"refusing to seal and unseal until a keystore check succeeds ({self.error})"
            )
        return (
            f"fenced out: served {self.fenced_out} call(s) on the last good ring without a keystore check "
            f"({self.error})"
        )

    def _fenced(self, reason: str) -> None:
        if self.error is None:
            self.fenced_since = self.clock()
            log.warning(
                "lease of %g s ran out and the keystore check failed: serving on the last good ring (fenced out): %s",
                self.lease,
                reason,
            )
            self._tell(reason)
        self.error = reason

    def _renewed(self) -> None:
        if self.error is not None:
            log.warning("keystore check succeeded again: the lease is renewed (was fenced out)")
            self.error = None
            self.fenced_since = None
            self._tell(None)

    def _tell(self, message: str | None) -> None:
        if self.on_fenced is not None:
            try:
                self.on_fenced(message)
            except Exception:
                log.exception("reporting the fence")
