"""The ring watcher: keeps a running codec (or the sidecar) on the newest key ring generation by itself.

One implementation serves every codec `mrtr_keys.open_codec` / `request_state_security` opens and
the sidecar. Every `interval` seconds (default 2; each wait is drawn from interval x [0.8, 1.2], so
a fleet started at once does not poll in step) it asks the keystore for its cheap `revision()` (a
``stat`` for a file; a metadata call for a remote keystore) and calls `reload()`, the full read,
only when that changed, or every time for a keystore without a cheap check (revision None). The
first check always reads, so a change made while the codec was being built is not missed.

A keystore that cannot be reached, or a ring that cannot be loaded, is kept in `error` and logged
once per distinct message (WARNING); the loaded ring stays in use and the next check tries again, so
the watcher recovers by itself when the keystore comes back. It is a daemon thread with a stop
(`stop()`), one check at a time, each bounded by the keystore's own timeouts. An `interval` of 0
turns watching off; `watch_codec` says so in the log.

Liveness: every check that completes (loaded, unchanged or failed) records its time (`last_check`).
A check that never returns (a keystore call with no deadline, a filesystem that hangs) would leave
the instance serving an old ring while looking healthy, so once the last completed check is older
than `STUCK_INTERVALS` intervals the watcher calls itself stuck (`stuck_since`, `stuck_note`): the
sidecar's ``/readyz`` (503 in strict mode), the presence heartbeat, ``mrtr-keys fleet status`` and the
rotation gates (`mrtr_keys.fleet.gates`) all read that (issue 22).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import threading
import time
import weakref
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from mrtr_keys.errors import ConfigError, MrtrKeysError

if TYPE_CHECKING:
    from mrtr_keys.keystores import Keystore

log = logging.getLogger("mrtr_keys.reload")

DEFAULT_INTERVAL = 2.0
"""Seconds between cheap change checks (the library's ``reload_every=``, the sidecar's ``--reload-interval``)."""
MAX_INTERVAL = 86400.0
_JITTER = random.Random()  # noqa: S311 (jitter, not a secret)
"""The watchers' own generator: their jitter never moves the process-wide `random` state."""

JITTER = 0.2
"""Each wait is ``interval * uniform(1 - JITTER, 1 + JITTER)``."""
STUCK_INTERVALS = 3
"""A running watcher whose last completed check is older than this many intervals is stuck."""
STUCK_NOTE = "watcher stuck since"
"""How a stuck watcher's note begins (presence rows carry it; `mrtr_keys.fleet.gates` looks for it)."""


def utc_text(when: float) -> str:
    """POSIX time `when` as ``2026-12-02T11:50:03Z`` (whole seconds, UTC)."""
    return datetime.fromtimestamp(when, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


lease_clock: Callable[[], float] = time.monotonic
"""The clock of `RingWatcher.ok_started` and of the self-fencing lease (`mrtr_keys.codecs.fence`): it never
goes back and keeps counting while the process is paused (SIGSTOP, a GC pause, a VM migration). It is read on
every seal and unseal, so it is the cheapest such clock (``CLOCK_BOOTTIME``, which also counts a machine's
sleep, costs twice as much a read from Python); a machine that slept is covered by the unknown-kid look and
by the watcher's next check."""


class WatchedGone(Exception):
    """Raised by a reload callable whose codec no longer exists: the watcher thread ends."""


class ReloadFailed(MrtrKeysError):
    """Raised by a reload callable that already logged why the ring could not be loaded: the
    watcher keeps the message in `error` and retries on the next check, without logging again."""


def check_interval(value: object, what: str = "reload_every") -> float:
    """`value` as an interval in seconds (0 = off).

    Raises:
        ConfigError: not a finite number from 0 to one day.
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not (ok and math.isfinite(value) and 0 <= value <= MAX_INTERVAL):  # type: ignore[operator, arg-type]
        raise ConfigError(f"{what} must be a number of seconds from 0 (off) to {MAX_INTERVAL:g}")
    return float(value)  # type: ignore[arg-type]


class RingWatcher:
    """Polls `keystore.revision()` and calls `reload()` when it changed (see the module docstring).

    Args:
        keystore: the keystore to watch (`mrtr_keys.keystores.Keystore`).
        reload: does the full read and switch; returns True if it switched to a new ring; raises
            `MrtrKeysError` (or `ReloadFailed`) if the ring could not be loaded, `WatchedGone` to end.
        interval: seconds between checks; 0 means the thread is never started (`check()` still works).
        every_check: optional callable run at the start of every check (the sidecar's client registry).
        on_switch: optional callable run after a reload that switched or was refused (presence heartbeat).
        on_error: optional callable told the error message when a check fails, and None when a check
            succeeds again (the sidecar's readiness and metrics).
        alive: optional callable asked before every check of the thread; once it returns False the thread
            ends without calling the keystore (`watch_codec`: the codec is garbage). `reload` raising
            `WatchedGone` alone is not enough: it runs only when the revision changed.
        rng: a uniform draw in [0, 1) for the jitter; by default this module's own `random.Random`, so the
            watcher never moves the process-wide `random` state (tests pass a constant).

    Attributes:
        error: why the last check failed, or None. checks / reads: counts of cheap checks and
        full reads. last_ok: POSIX time of the last successful check. last_check: POSIX time of the
        last completed check, successful or not (None before the first). ok_started: `lease_clock` time
        at which the last successful check *started* (what it read is at least that fresh).

    Raises (constructor):
        ConfigError: a bad interval.
    """

    def __init__(
        self,
        keystore: Keystore,
        reload: Callable[[], Any],
        *,
        interval: float = DEFAULT_INTERVAL,
        every_check: Callable[[], Any] | None = None,
        on_switch: Callable[[], Any] | None = None,
        on_error: Callable[[str | None], Any] | None = None,
        rng: Callable[[], float] | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        self.keystore = keystore
        self._alive = alive
        self.interval = check_interval(interval)
        self._reload = reload
        self._every_check = every_check
        self.on_switch = on_switch
        self.on_error = on_error
        self._rng = rng if rng is not None else _JITTER.random
        self.error: str | None = None
        self.checks = 0
        self.reads = 0
        self.last_ok: float | None = None
        self.last_check: float | None = None
        self._since = (time.time(), time.monotonic())
        """(POSIX, monotonic) time of the last completed check, else of `start()`: what `stuck_since` measures."""
        self.ok_started: float | None = None
        self._revision: str | None = None
        self._force = True  # the first check always reads (see the module docstring)
        self._wake = threading.Event()
        self._stopping = False
        self._check_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"RingWatcher({self.keystore.url!r}, interval={self.interval:g}, error={self.error!r})"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stuck_since(self, now: float | None = None) -> float | None:
        """POSIX time of the last completed check (or of `start()`) when that is more than
        `STUCK_INTERVALS` intervals before `now` (monotonic seconds, default now) while the thread is
        meant to run; else None. Never stuck with watching off (interval 0) or before `start()`."""
        if self._thread is None or self._stopping or self.interval == 0:
            return None
        wall, mono = self._since
        now = time.monotonic() if now is None else now
        return wall if now - mono > STUCK_INTERVALS * self.interval else None

    def stuck_note(self, now: float | None = None) -> str | None:
        """``watcher stuck since 2026-12-02T11:50:03Z (...)`` when `stuck_since` says so, else None.
        The text stays the same while it stays stuck (a heartbeat writes it only when it changes)."""
        since = self.stuck_since(now)
        if since is None:
            return None
        return (
            f"{STUCK_NOTE} {utc_text(since)} (no key ring check completed in {STUCK_INTERVALS} intervals of "
            f"{self.interval:g} s; the loaded ring may be behind the keystore)"
        )

    def next_delay(self) -> float:
        """Seconds until the next check: `interval` scaled by a factor in [1 - JITTER, 1 + JITTER]."""
        return self.interval * (1 - JITTER + 2 * JITTER * self._rng())

    def check(self) -> bool:
        """One check, in the caller's thread: cheap revision, full reload if it changed. True if switched.

        Never raises `MrtrKeysError` (it lands in `error`); raises `WatchedGone` from `reload`.
        """
        with self._check_lock:
            try:
                read, switched = self._check()
            finally:  # completed, whatever the outcome: the watcher is alive (`stuck_since`)
                self.last_check = time.time()
                self._since = (self.last_check, time.monotonic())
        if read and self.on_switch is not None:
            try:
                self.on_switch()
            except Exception:
                log.exception("after a key ring reload")
        return switched

    def _check(self) -> tuple[bool, bool]:
        """The check proper (lock held): (whether the ring was read and used, whether it switched)."""
        started = lease_clock()
        self.checks += 1
        try:
            if self._every_check is not None:
                self._every_check()
            rev = self.keystore.revision()
            if rev is not None and rev == self._revision and not self._force:
                self._ok()
                self.ok_started = started
                return False, False
            self._force = False
            self.reads += 1
            switched = bool(self._reload())
        except WatchedGone:
            raise
        except MrtrKeysError as exc:
            self._fail(str(exc), logged=isinstance(exc, ReloadFailed))
            return False, False
        except Exception as exc:  # the watcher must survive anything; the error stays visible
            log.exception("key ring check failed")
            self._fail(f"{type(exc).__name__}: {exc}", logged=True)
            return False, False
        self._revision = rev
        self._ok()
        self.ok_started = started
        return True, switched

    def _ok(self) -> None:
        if self.error is not None:
            log.warning("key ring %s reachable again", self.keystore.url)
            self.error = None
            self._tell(None)
        self.last_ok = time.time()

    def _fail(self, message: str, *, logged: bool) -> None:
        self._force = True  # read fully on the next check whatever the revision says
        if message != self.error and not logged:
            log.warning("key ring not reloaded, the loaded ring stays in use: %s", message)
        self.error = message
        self._tell(message)

    def _tell(self, message: str | None) -> None:
        if self.on_error is not None:
            try:
                self.on_error(message)
            except Exception:
                log.exception("reporting a key ring check")

    def start(self) -> RingWatcher:
        """Start the daemon thread (not when `interval` is 0). Returns self."""
        if self.interval > 0 and self._thread is None:
            if self.last_check is None:
                self._since = (time.time(), time.monotonic())
            self._thread = threading.Thread(target=self._run, name="mrtr-keys-ring-watcher", daemon=True)
            self._thread.start()
        return self

    def wake(self) -> None:
        """Check now, with a full read whatever the revision says (the sidecar's SIGHUP); with the
        thread off (interval 0), in a one-off thread. A stuck watcher cannot be woken: that is logged."""
        note = self.stuck_note()
        if note is not None:
            log.warning("key ring check requested; it waits for the check in progress: %s", note)
        self._force = True
        if self.running:
            self._wake.set()
        elif not self._stopping:
            threading.Thread(target=self._check_once, name="mrtr-keys-ring-check", daemon=True).start()

    def _check_once(self) -> None:
        with contextlib.suppress(WatchedGone):
            self.check()

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread (waits up to `timeout` seconds for a check in progress)."""
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.next_delay())
            self._wake.clear()
            if self._stopping or (self._alive is not None and not self._alive()):
                break
            try:
                self.check()
            except WatchedGone:
                break
        self._stopping = True  # ended for good: never stuck (`stuck_since`), and `wake()` checks nothing


def watch_codec(
    codec: Any, keystore: Keystore, *, interval: float, on_switch: Callable[[], Any] | None = None
) -> RingWatcher | None:
    """Start a `RingWatcher` that calls ``codec.reload()``; None (and a WARNING) when `interval` is 0.

    The watcher holds the codec weakly: once the codec is garbage, the thread ends at its next check
    (whether or not the keystore changed meanwhile), with no keystore call.
    """
    interval = check_interval(interval)
    if interval == 0:
        ring = getattr(codec, "ring", None)
        log.warning(
            "automatic key ring reload is off (reload_every=0): this instance keeps generation %s until "
            "restarted or codec.reload() is called, and holds back the rotation gates",
            getattr(ring, "generation", "?"),
        )
        return None
    ref = weakref.ref(codec)

    def reload() -> bool:
        target = ref()
        if target is None:
            raise WatchedGone
        switched = bool(target.reload())
        if switched:
            log.info("key ring reloaded: generation %s", getattr(getattr(target, "ring", None), "generation", "?"))
        return switched

    def alive() -> bool:
        return ref() is not None

    return RingWatcher(keystore, reload, interval=interval, on_switch=on_switch, alive=alive).start()
