"""Re-checking the wrapping key of a data-key ring, so a key disabled in KMS or Vault reaches every instance.

The KMS-envelope and Vault data-key codecs unwrap their data keys once, when a ring loads, and then seal
and open without a remote call per token (as the MCP SDK's codec contract asks). Without more, disabling
the KMS key, removing the instance's Vault policy or raising the transit key's ``min_decryption_version``
(a security team's first move on a suspected leak) would change nothing until each process restarts.

`KekCheck` runs in a daemon thread, off the serving path, one for each wrapping key in a process
(`shared_check`: every codec of that key shares it): every `every` seconds (the library's
``kek_check_every=``, ``MRTR_KEYS_KEK_CHECK_EVERY``, ``serve --kek-check-every``; default
`DEFAULT_EVERY`, 0 = off; each wait is drawn from every x [0.8, 1.0], never longer) it asks the codec for
one cheap authenticated call (``check_wrapping_key``: unwrap the primary's data key once more, KMS
``Decrypt`` or Vault ``transit/decrypt``) and classifies the answer:

* **ok**: serving. Codecs that had failed closed rebuild their keys (one unwrap per usable key) and serve
  again, with a WARNING.
* **revoked** (`WrappingKeyRevoked`: the key is disabled, pending deletion, deleted or denied): every codec
  of the key **fails closed** at once: it forgets its data keys and installs `ClosedCore`, so `seal` raises
  `WrappingKeyRevoked` and `unseal` raises `InvalidRequestState` with the reason `WRAPPING_KEY_REVOKED`
  (audit reason and metric label); a WARNING says what happened and what to do. Within one interval plus
  the call's own deadline of the change.
* **unreachable** (`BackendUnavailable`, or anything else: a timeout, a refused connection, 5xx,
  throttling, no credentials from the instance metadata): an outage is not a revocation. The codec keeps
  serving on the data keys it holds, the check is retried every `RETRY_UNREACHABLE` seconds (or `every`,
  if shorter), and `error` says why (a WARNING once per distinct message). A codec that had failed closed
  stays closed until an ok answer.

`state`, `closed`, `error`, `last_ok` and `last_check` say where it stands (the sidecar's ``/readyz``, its
metrics, presence notes); `TOTALS` counts every check's result in this process (the metrics).
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
import weakref
from collections import Counter
from collections.abc import Hashable
from typing import Any, NoReturn

from mrtr_keys.codecs.aesgcm import rejected
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.errors import ConfigError, MrtrKeysError, WrappingKeyRevoked
from mrtr_keys.tracing import kid_of

log = logging.getLogger("mrtr_keys.kek")

ENV_EVERY = "MRTR_KEYS_KEK_CHECK_EVERY"
DEFAULT_EVERY = 300.0
"""Seconds between two checks of the wrapping key (Asherah's ``revokeCheckMinutes`` is 60 by default; one
cheap call every 5 minutes costs a fleet of 100 instances about 29,000 KMS requests a day)."""
MAX_EVERY = 86400.0
RETRY_UNREACHABLE = 10.0
"""Seconds between checks while the wrapping key's service cannot be reached."""
WRAPPING_KEY_REVOKED = "wrapping key revoked"
"""The reason code of an unseal refused while the codec fails closed."""
UNCHECKED, OK, UNREACHABLE, REVOKED = "unchecked", "ok", "unreachable", "revoked"

TOTALS: Counter[str] = Counter()
"""Checks of every `KekCheck` of this process, by result (`OK`, `UNREACHABLE`, `REVOKED`): a metric's source."""
LIVE: weakref.WeakSet[KekCheck] = weakref.WeakSet()
"""Every running `KekCheck` of this process (metrics read their state)."""
_rng = random.Random()  # noqa: S311 (jitter, not a secret)


def check_every(value: object = None) -> float:
    """`value` (None: ``MRTR_KEYS_KEK_CHECK_EVERY``, else `DEFAULT_EVERY`) as seconds between checks (0 = off).

    Raises:
        ConfigError: not 0 and not a number from 0.1 to one day.
    """
    if value is None:
        text = os.environ.get(ENV_EVERY, "").strip()
        if not text:
            return DEFAULT_EVERY
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{ENV_EVERY} must be a number of seconds (0: off), not {text[:20]!r}") from None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and (value == 0 or 0.1 <= value <= MAX_EVERY)):  # type: ignore[operator]
        raise ConfigError(f"kek_check_every must be 0 (off) or a number of seconds from 0.1 to {MAX_EVERY:g}")
    return float(value)  # type: ignore[arg-type]


class ClosedCore:
    """The token core of a codec that fails closed: nothing seals, every token is refused."""

    __slots__ = ("_observer", "reason")

    def __init__(self, reason: str, observer: CodecObserver | None) -> None:
        self.reason = reason
        self._observer = observer

    def __repr__(self) -> str:
        return "ClosedCore()"

    def seal(self, payload: bytes) -> str:
        raise WrappingKeyRevoked(f"sealing refused: {self.reason}")

    def unseal(self, token: str) -> NoReturn:
        rejected(self._observer, kid_of(token), token, WRAPPING_KEY_REVOKED)


class KekCheck:
    """The check of one wrapping key, shared by every codec of this process that holds data keys it wrapped
    (see the module docstring; `shared_check` gives a codec its key's check).

    Args:
        every: seconds between checks (0: the thread is never started; `check()` still works).
        what: the wrapping key, for log lines (``KMS key arn:...``, ``Vault transit key transit/keys/NAME``).
        rng: a uniform draw in [0, 1) for the jitter (tests pass a constant).

    Codecs are `add`-ed and held weakly: ``check_wrapping_key()`` (of the newest) makes the one call and
    raises `WrappingKeyRevoked` or another error; ``fail_closed(reason)`` and ``serve_again()`` switch each.
    The thread ends once no codec is left.
    """

    def __init__(self, every: float, *, what: str, rng: Any = None) -> None:
        self.every = check_every(every)
        self.what = what
        self._rng = rng or _rng.random
        self._codecs: list[weakref.ref[Any]] = []
        self.state = UNCHECKED
        self.closed: str | None = None
        """Why its codecs fail closed now, else None."""
        self.closed_since: float | None = None
        """POSIX time since when they fail closed (None: they do not)."""
        self.error: str | None = None
        """Why the last check could not reach the key (an outage), else None."""
        self.last_ok: float | None = None
        self.last_check: float | None = None
        self.checks: Counter[str] = Counter()
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()
        self._list_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"KekCheck({self.what!r}, every={self.every:g}, state={self.state!r})"

    def add(self, codec: Any) -> KekCheck:
        """Check for `codec` too (held weakly). A codec added while the others fail closed has just unwrapped its
        keys, so the key may answer again: the next check comes at once."""
        with self._list_lock:  # not the check's lock: a check in flight (up to its deadline) must not hold this up
            self._codecs = [r for r in self._codecs if r() is not None] + [weakref.ref(codec)]
        if self.closed is not None:
            self._wake.set()
        weakref.finalize(codec, self._wake.set)  # the last codec gone ends the thread at once
        return self

    def codecs(self) -> list[Any]:
        """The codecs still alive, oldest first."""
        return [c for r in self._codecs if (c := r()) is not None]

    def status(self) -> dict[str, Any]:
        """``wrapping_key``, ``state``, ``closed``, ``closed_since``, ``error``, ``every_seconds``, ``last_ok``
        and ``last_check`` (POSIX times)."""
        return {
            "wrapping_key": self.what,
            "state": self.state,
            "closed": self.closed,
            "closed_since": self.closed_since,
            "error": self.error,
            "every_seconds": self.every,
            "last_ok": self.last_ok,
            "last_check": self.last_check,
        }

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> KekCheck:
        if self.every > 0 and self._thread is None:
            LIVE.add(self)
            self._thread = threading.Thread(target=self._run, name="mrtr-keys-kek-check", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def next_delay(self) -> float:
        """`every` x [0.8, 1.0] (never longer, so a revocation is seen within one interval), or
        `RETRY_UNREACHABLE` while the last check could not reach the key."""
        base = self.every * (0.8 + 0.2 * self._rng())
        return min(base, RETRY_UNREACHABLE) if self.state == UNREACHABLE else base

    def check(self) -> str:
        """One check in the caller's thread; returns the new `state` (no codec left: `state` unchanged)."""
        with self._lock:
            codecs = self.codecs()
            if not codecs:
                return self.state
            try:
                codecs[-1].check_wrapping_key()  # the newest: the ring most recently loaded
            except WrappingKeyRevoked as exc:
                self._revoked(codecs, str(exc))
            except MrtrKeysError as exc:
                self._unreachable(str(exc))
            except Exception as exc:  # the loop must survive anything; an unknown failure is not a revocation
                self._unreachable(f"{type(exc).__name__}: {exc}")
            else:
                self._ok(codecs)
            self.last_check = time.time()
            TOTALS[self.state] += 1
            self.checks[self.state] += 1
            return self.state

    def _ok(self, codecs: list[Any]) -> None:
        if self.closed is not None:
            failed = []
            for codec in codecs:
                try:
                    codec.serve_again()
                except MrtrKeysError as exc:  # another key of its ring still does not unwrap
                    failed.append(str(exc))
            if failed:
                self.state, self.closed = REVOKED, f"{self.closed}; serving again failed: {failed[0]}"
                return
            log.warning("the wrapping key (%s) answers again: this instance seals and opens tokens again", self.what)
        elif self.error is not None:
            log.warning("the wrapping key (%s) can be reached again", self.what)
        self.state, self.closed, self.closed_since, self.error = OK, None, None, None
        self.last_ok = time.time()

    def _revoked(self, codecs: list[Any], detail: str) -> None:
        first = self.closed is None
        self.state, self.error = REVOKED, None
        if first:
            self.closed, self.closed_since = detail, time.time()
            for codec in codecs:
                codec.fail_closed(detail)
            log.warning(
                "the wrapping key (%s) is disabled, deleted or denied to this instance (%s): it no longer seals and "
                "refuses every token (reason %r) until the key answers again, checked every %g s. On an incident, "
                "revoke the keys it wrapped (mrtr-keys keys revoke KID) and rotate under a new wrapping key; if it "
                "was disabled by mistake, enable it or restore the policy (docs/kms.md, docs/vault.md)",
                self.what,
                detail,
                WRAPPING_KEY_REVOKED,
                self.every,
            )

    def _unreachable(self, detail: str) -> None:
        if detail != self.error:
            held = "still failing closed" if self.closed else "still serving on the data keys it holds"
            log.warning(
                "the wrapping key (%s) could not be checked (%s): an outage, not a revocation; %s, retrying in %g s",
                self.what,
                detail,
                held,
                min(self.every, RETRY_UNREACHABLE),
            )
        self.error = detail
        if self.closed is None:
            self.state = UNREACHABLE

    def note(self) -> str | None:
        """A presence note while failing closed or unable to check (``fleet status``), else None."""
        if self.closed:
            return f"failing closed: the wrapping key ({self.what}) is disabled, deleted or denied ({self.closed})"
        if self.error:
            return f"the wrapping key ({self.what}) could not be checked, serving on the data keys held ({self.error})"
        return None

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.next_delay())
            self._wake.clear()
            if not self._stopping and not self.codecs():
                with _shared_lock:  # `shared_check` adds under this lock: none is added to a check that ends
                    if not self.codecs():
                        self._stopping = True
            if self._stopping:
                break
            self.check()
        LIVE.discard(self)
        with _shared_lock:
            for key, check in list(_shared.items()):
                if check is self:
                    del _shared[key]


_shared: dict[Hashable, KekCheck] = {}
_shared_lock = threading.Lock()


def shared_check(key: Hashable, codec: Any, every: float, *, what: str) -> KekCheck:
    """The started check of the wrapping key `key` in this process, made on first use, with `codec` added:
    the codecs of one wrapping key (a sidecar's codec per audience, a new generation's beside the old) share
    one check, so an instance makes one call an interval and they all fail closed, and serve again, together.
    The interval is the shortest any of them asked for.

    `key` names the key and who asks (the client or its settings: another set of credentials may get
    another answer)."""
    with _shared_lock:
        check = _shared.get(key)
        if check is None or check._stopping:
            check = _shared[key] = KekCheck(every, what=what)
        elif every < check.every:
            check.every = every
            check._wake.set()
        check.add(codec)
    return check.start()


_STATE_VALUE = {UNCHECKED: 0.0, OK: 0.0, UNREACHABLE: 1.0, REVOKED: 2.0}


class KekCollector:
    """A prometheus-client collector of this process's wrapping-key checks, named ``{prefix}_wrapping_key_*``:
    ``checks_total{result}`` (`TOTALS`) and ``state`` (the worst of the running checks: 0 ok, 1 unreachable,
    2 revoked: failing closed). The library registers it as ``mrtr_keys``, the sidecar as ``mrtr_sidecar``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        checks = CounterMetricFamily(
            f"{self.prefix}_wrapping_key_checks",
            "Checks of the wrapping key (KMS key, Vault transit key) of data-key rings, by result.",
            labels=["result"],
        )
        for result in (OK, UNREACHABLE, REVOKED):
            checks.add_metric([result], float(TOTALS[result]))
        yield checks
        states = [_STATE_VALUE[c.state] for c in list(LIVE)]
        yield GaugeMetricFamily(
            f"{self.prefix}_wrapping_key_state",
            "Wrapping key: 0 answers (or unchecked yet), 1 unreachable (serving), 2 disabled or denied (failing "
            "closed); the worst of this process's data-key codecs.",
            value=max(states, default=0.0),
        )
