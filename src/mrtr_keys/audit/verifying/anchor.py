"""Heads anchored by the service itself: every `DEFAULT_EVERY` seconds, the heads of the chains this process
writes, MACed with the chain key, appended where the database cannot reach them.

A cut-off tail (a writer's newest records deleted) leaves a chain that verifies; only a record of its head
kept elsewhere shows it (docs/audit.md, Checkpoints). ``audit checkpoint`` from cron writes such records if
someone set it up; an anchor is the same record written by the service, with no set-up beyond a place to
keep it: ``serve --audit-anchor DEST`` (and ``--audit-anchor-every``), the library's ``audit_anchor=``, or
``MRTR_KEYS_AUDIT_ANCHOR``. DEST is a file, a directory or ``s3://BUCKET/PREFIX`` with Object Lock
(`mrtr_keys.audit.verifying.ledger`); ``audit verify --checkpoints DEST`` reads it.

An anchor record::

    {"kind": "anchor", "time": T, "store": URL, "store_id": S, "instance": "host:pid:start#n",
     "heads": [{"writer", "seq", "hash", "time"}, ...], "chain_switch": {...}, "mac": "v2:KEYID:..."}

``heads`` are what the sink's writers reported stored (`mrtr_keys.audit.capture.sink.AuditSink.heads`: its own
chain, and each writer process's as acknowledged), never read back from the store. The MAC
(`mrtr_keys.audit.writing.chain_key.ChainKey.sign`) means whoever can write DEST but lacks the key cannot add a
record ``verify`` would trust.

Rules: a background thread (never the event loop, never a request's path); a run that fails (a directory
that cannot be written, S3 silent or refusing) is a WARNING, once per distinct error, and a count; sealing
goes on; each run tries again. Every S3 call has a deadline (`mrtr_keys.audit.verifying.ledger.S3_DEADLINES`).
`Anchorer.status` says when the last run succeeded (the sidecar's authenticated ``/readyz`` and ``/metrics``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from mrtr_keys.audit.events import format_ts
from mrtr_keys.audit.verifying.ledger import ANCHOR, Ledger, open_ledger, stem
from mrtr_keys.audit.verifying.store_match import stamp
from mrtr_keys.audit.writing import switch
from mrtr_keys.audit.writing.chain_key import ChainKeys
from mrtr_keys.errors import ConfigError

log = logging.getLogger("mrtr_keys.audit.verifying.anchor")

ENV_ANCHOR = "MRTR_KEYS_AUDIT_ANCHOR"
"""The anchor destination when none is given (``serve --audit-anchor``, ``audit_anchor=``)."""
ENV_EVERY = "MRTR_KEYS_AUDIT_ANCHOR_EVERY"
DEFAULT_EVERY = 300.0
"""Seconds between anchors."""
MIN_EVERY, MAX_EVERY = 0.05, 86_400.0


def check_every(every: object) -> float:
    """`every` as seconds between anchors.

    Raises:
        ConfigError: not a number of seconds in [`MIN_EVERY`, `MAX_EVERY`].
    """
    try:
        value = float(every)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = float("nan")
    if isinstance(every, bool) or not MIN_EVERY <= value <= MAX_EVERY:
        raise ConfigError(f"audit_anchor_every must be a number of seconds from {MIN_EVERY:g} to {MAX_EVERY:g}")
    return value


def configured(dest: str | None, every: object | None) -> tuple[str | None, float]:
    """(destination, seconds) from the arguments, else ``MRTR_KEYS_AUDIT_ANCHOR`` and
    ``MRTR_KEYS_AUDIT_ANCHOR_EVERY``; an empty destination is off (None).

    Raises:
        ConfigError: a bad interval, or a destination that cannot be one.
    """
    where = dest if dest is not None else os.environ.get(ENV_ANCHOR, "")
    seconds = check_every(every if every is not None else os.environ.get(ENV_EVERY) or DEFAULT_EVERY)
    if not where.strip():
        return None, seconds
    open_ledger(where)  # refuses a bad location now, not at the first run
    return where, seconds


class Anchorer:
    """Appends the heads of `sink`'s chains to `dest` every `every` seconds (see the module docstring).

    Args:
        sink: the `mrtr_keys.audit.capture.sink.AuditSink` whose chains are anchored (its `heads`, `chain_key`,
            `store`, `writer`).
        dest: a file, directory or ``s3://BUCKET/PREFIX`` (`mrtr_keys.audit.verifying.ledger.open_ledger`).
        every: seconds between runs.

    Raises:
        ConfigError: `dest` cannot be an anchor destination, or `every` is out of range.
    """

    def __init__(self, sink: Any, dest: str, *, every: float = DEFAULT_EVERY, clock: Any = time.time) -> None:
        self.sink = sink
        self.ledger: Ledger = open_ledger(dest)
        self.every = check_every(every)
        self._clock = clock
        self.last_success: float | None = None
        self.last_attempt: float | None = None
        self.last_error: str | None = None
        self.anchors = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one run at a time (the thread's, and a final one at stop)
        self._switch: dict[str, Any] | None = None
        """The store's switch to keyed links, read once (it never moves): each anchor notes it."""

    def __repr__(self) -> str:
        return f"Anchorer({self.ledger.uri!r}, every={self.every:g})"

    def start(self) -> None:
        """Start the thread (its first run after one interval)."""
        self._thread = threading.Thread(target=self._loop, name="mrtr-audit-anchor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0, *, final: bool = True) -> None:
        """Stop the thread; with `final`, anchor once more (the heads as they are at shutdown, after the
        sink's last flush), waiting at most `timeout` seconds for a run in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if final and self._lock.acquire(timeout=timeout):
            try:
                self._run()
            finally:
                self._lock.release()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.run_once()

    def run_once(self) -> bool:
        """One run (what the thread does each interval); True if it succeeded. Never raises."""
        with self._lock:
            return self._run()

    def _run(self) -> bool:
        now = self._clock()
        self.last_attempt = now
        try:
            doc = self.record(now)
            if doc is not None:
                self.ledger.append(doc, stem(self.sink.writer))
                self.anchors += 1
        except Exception as exc:  # a background loop never dies of one bad run, and never stops sealing
            self.failures += 1
            message = f"audit anchor to {self.ledger.uri} failed: {exc}"
            if message != self.last_error:
                log.warning("%s (sealing goes on; tried again in %g s)", message, self.every)
            self.last_error = message
            return False
        self.last_success, self.last_error = now, None
        return True

    def record(self, now: float) -> dict[str, Any] | None:
        """The anchor record of the sink's chains now (None before any of them stored a batch)."""
        heads = self.sink.heads()
        if not heads:
            return None
        store = self.sink.store
        doc = stamp({"kind": ANCHOR, "time": format_ts(now)}, store)
        doc["instance"] = self.sink.writer
        doc["heads"] = [{"writer": w, "seq": s, "hash": h, "time": t} for w, (s, h, t) in sorted(heads.items())]
        if self._switch is None and switch.has_meta(store):
            try:  # a store that does not answer now: this anchor goes without the note, a later one has it
                found = switch.read(store, ChainKeys([self.sink.chain_key]))
            except Exception:
                found = None
            if found is not None and found.problem is None:
                self._switch = found.to_json()
        if self._switch is not None:
            doc[switch.NAME] = self._switch
        return dict(self.sink.chain_key.sign(doc))

    def status(self) -> dict[str, Any]:
        """``/readyz``'s ``audit_anchor``: where, how often, and when a run last succeeded (UTC text)."""
        return {
            "destination": self.ledger.uri,
            "every_seconds": self.every,
            "last_success": None if self.last_success is None else format_ts(self.last_success),
            "last_attempt": None if self.last_attempt is None else format_ts(self.last_attempt),
            "anchors": self.anchors,
            "failures": self.failures,
            "error": self.last_error,
        }


_started: dict[tuple[int, str], Anchorer] = {}
_started_lock = threading.Lock()


def anchor_sink(sink: Any, dest: str, every: float) -> Anchorer:
    """The process's one running `Anchorer` of `sink` to `dest` (started on first use; a library codec opened
    twice over one sink anchors once).

    Raises:
        ConfigError: a bad destination or interval.
    """
    key = (id(sink), dest)
    with _started_lock:
        found = _started.get(key)
        if found is None or found.sink is not sink:
            found = _started[key] = Anchorer(sink, dest, every=every)
            found.start()
        return found
