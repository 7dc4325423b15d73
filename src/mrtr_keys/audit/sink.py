"""The audit sink: a bounded queue drained in the background into a store, by a thread or a process.

The caller's side (`submit`) is one ``len`` check and one ``deque.append`` of a small list: no lock,
no hashing, no I/O, so a seal never waits for the audit log. Two writers (``mode``):

* ``"process"`` (the default of `shared_sink`, so of in-process codecs, the sidecar and the CLI):
  a light shipper thread wakes every `interval` (5 ms), takes everything queued (one C call),
  serialises it with `marshal` (C) and writes it to a pipe. A child process
  (`mrtr_keys.audit.writer.child`, started on the first batch, restarted on the next batch after
  it died) fingerprints, chains and stores, on its own interpreter lock and CPU, and acknowledges
  each transaction. The caller's process pays only the queue append and the shipping.
* ``"thread"``: the writer thread wakes every `interval` (50 ms) and fingerprints the tokens (HMAC,
  `mrtr_keys.audit.fingerprint`), chains the events (`mrtr_keys.audit.chain`) and appends them in
  one transaction itself, holding this process's interpreter lock while it does
  (``MRTR_KEYS_AUDIT_WRITER=thread`` makes `shared_sink` use it).

A full queue drops the event, increments `dropped` and logs a WARNING on the ``mrtr_keys.audit``
logger (at most every `DROP_LOG_INTERVAL` seconds): never blocking, never silent. A failed write
is retried with the same batch (the chain stays gap-free); meanwhile the queue fills and drops.
`healthy` is False while writes fail or after the writer process died (the sidecar's /readyz and
strict mode use it); events shipped to a process that died unacknowledged count as dropped.
Synchronous writes (`write_now`) always happen in the caller's process, on the sink's own chain.

Each batch is held back for one cycle before it is written, so that a rejection the MCP SDK
reports just after our codec unsealed a token (`mrtr_keys.audit.sdk_capture`) turns that
``unseal ok`` into one ``unseal rejected`` event with the SDK's reason, instead of two events.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat, starmap
from typing import TYPE_CHECKING, Any, Literal

from mrtr_keys.audit.chain import ChainWriter, event_values
from mrtr_keys.audit.events import OK, OP_UNSEAL, REJECTED, AuditEvent, format_ts, instance_id
from mrtr_keys.audit.fingerprint import Fingerprinter
from mrtr_keys.audit.stores.base import AuditStore
from mrtr_keys.errors import AuditError

if TYPE_CHECKING:
    from mrtr_keys.audit.writer.parent import ChildWriter

logger = logging.getLogger("mrtr_keys.audit")

DEFAULT_CAPACITY = 50_000
"""Events the queue holds before it drops: about 0.7 KB each with a typical 440-character token, so
about 35 MB at most (the sidecar exports the current depth as ``mrtr_sidecar_audit_queued``)."""
DEFAULT_BATCH = 2_000
DEFAULT_INTERVAL = 0.05
"""Seconds between writer wake-ups (thread mode)."""
PROCESS_INTERVAL = 0.005
"""Seconds between shipper wake-ups (process mode: shipping is cheap, so ship often)."""
PROCESS_BATCH = 100_000
"""Most events per shipper wake-up (process mode ships everything queued each wake-up)."""
PROCESS_FRAME = 2_000
"""Most events per frame sent to the writer child: small frames keep the child's memory flat (one
100k-event frame decoded to ~100 MB there)."""
ENV_WRITER = "MRTR_KEYS_AUDIT_WRITER"
"""``thread`` or ``process`` (default): the writer `shared_sink` uses."""
Mode = Literal["thread", "process"]
IDLE_INTERVAL = 0.5
"""Seconds between wake-ups while nothing is queued (an idle sink costs almost nothing)."""
PROCESS_IDLE_INTERVAL = 0.05
"""The same for a process-mode shipper: a burst after an idle spell starts reaching the writer
process within 50 ms (not 0.5 s), so its work overlaps the burst instead of following it."""
DROP_LOG_INTERVAL = 10.0

# An item is a list (mutable, so a later SDK rejection can amend a held unseal):
# [op, outcome, kid, token, reason, time, audience, generation, client, duration_ms]
OP, OUTCOME, KID, TOKEN, REASON, TIME, AUDIENCE, GENERATION, CLIENT, DURATION = range(10)

_writer_ids = itertools.count(1)
_live: weakref.WeakSet[AuditSink] = weakref.WeakSet()


def writer_mode() -> Mode:
    """The writer `shared_sink` uses: ``MRTR_KEYS_AUDIT_WRITER`` (``thread``/``process``), else process.

    Raises:
        ConfigError: another value.
    """
    value = (os.environ.get(ENV_WRITER) or "process").strip().lower()
    if value == "process":
        return "process"
    if value == "thread":
        return "thread"
    from mrtr_keys.errors import ConfigError

    raise ConfigError(f"{ENV_WRITER} must be 'thread' or 'process', not {value!r}")


class AuditSink:
    """Queue + background writer for one store (see the module docstring).

    Args:
        store: an open `AuditStore` (the sink owns and closes it; process mode uses it for
            `write_now` and reads, and the child opens its own connection).
        fingerprinter: fingerprints tokens (thread mode), or hands its key to the child.
        capacity: queue bound (events); `batch`: most events per write; `interval`: writer period
            (s; default 0.05 for a thread, 0.005 for a process).
        mode: ``"thread"`` or ``"process"`` (see the module docstring).
        url: the store URL the child opens (process mode; default `store.url`, which has any
            password removed, so pass the real one for a password-protected PostgreSQL).
    """

    def __init__(
        self,
        store: AuditStore,
        fingerprinter: Fingerprinter,
        *,
        capacity: int = DEFAULT_CAPACITY,
        batch: int | None = None,
        interval: float | None = None,
        reopen: Callable[[], AuditStore] | None = None,
        mode: Mode = "thread",
        url: str | None = None,
    ) -> None:
        if mode not in ("thread", "process"):
            raise ValueError("mode must be 'thread' or 'process'")
        process = mode == "process"
        batch = batch if batch is not None else PROCESS_BATCH if process else DEFAULT_BATCH
        interval = interval if interval is not None else PROCESS_INTERVAL if process else DEFAULT_INTERVAL
        if capacity < 1 or batch < 1 or not interval > 0:
            raise ValueError("capacity and batch must be >= 1, interval > 0")
        self.store = store
        self.mode: Mode = mode
        self.capacity = capacity
        self.batch = batch
        self.interval = interval
        self._url = url or store.url
        self._child: ChildWriter | None = None
        self.children_started = 0
        """Writer processes started (process mode; more than 1 means one died and was replaced)."""
        self._fp = fingerprinter
        self._reopen = reopen
        self.dropped = 0
        """Events dropped because the queue was full (or the sink closed)."""
        self.written = 0
        self.write_failures = 0
        self.last_error: str | None = None
        self._start()
        _live.add(self)

    def _start(self) -> None:
        self._q: deque[list[Any]] = deque()
        self._retracts: deque[tuple[list[Any], str]] = deque()
        self._chain = ChainWriter(f"{instance_id()}#{next(_writer_ids)}")
        self._drop_lock = threading.Lock()
        self._last_drop_log = 0.0
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._flush_requested = 0
        self._flush_done = 0
        self._stopping = False
        self._closed = False
        self._held: list[list[Any]] = []
        self._retry: list[tuple[object, ...]] = []
        self._thread = threading.Thread(target=self._run, name=f"mrtr-keys-audit-{self._chain.writer}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"AuditSink({self.store.url!r}, mode={self.mode}, queued={len(self._q)}, dropped={self.dropped})"

    @property
    def writer(self) -> str:
        """This sink's chain id (``host:pid:start#n``)."""
        return self._chain.writer

    @property
    def child_pid(self) -> int | None:
        """The writer process's pid while it runs (process mode), else None."""
        child = self._child
        return child.pid if child is not None and child.alive else None

    @property
    def queued(self) -> int:
        return len(self._q)

    @property
    def healthy(self) -> bool:
        """False while the last write to the store failed, or after the writer process died
        (until a new one has stored a batch)."""
        return self.last_error is None and not self._closed

    # -- the caller's side (hot path) ------------------------------------------------------------

    def submit(self, item: list[Any]) -> None:
        """Queue one item (see the layout above); never blocks, never raises."""
        if len(self._q) < self.capacity:
            self._q.append(item)
        else:
            self._drop()

    def record(
        self,
        op: str,
        *,
        outcome: str = OK,
        audience: str | None = None,
        client: str | None = None,
        kid: str | None = None,
        reason: str | None = None,
        token: str | None = None,
        duration_ms: float | None = None,
        generation: int | None = None,
    ) -> None:
        """Queue one event by name (the sidecar's seam: one call per request). `token` is only
        fingerprinted, in the writer thread, and never stored."""
        self.submit([op, outcome, kid, token, reason, time.time(), audience, generation, client, duration_ms])

    def retract(self, item: list[Any], reason: str) -> None:
        """Turn a queued ``unseal ok`` `item` into ``unseal rejected`` with `reason` (SDK capture).

        Applied by the background thread before the item leaves this process (items are held one
        cycle for this); if it already left, the rejection is recorded as an event of its own."""
        if len(self._retracts) < self.capacity:
            self._retracts.append((item, reason))
        else:
            self._drop()

    def _drop(self, n: int = 1) -> None:
        with self._drop_lock:
            self.dropped += n
            now = time.monotonic()
            if now - self._last_drop_log >= DROP_LOG_INTERVAL or self.dropped == 1:
                self._last_drop_log = now
                logger.warning(
                    "audit queue full (%d events): %d events dropped so far (store %s)",
                    self.capacity,
                    self.dropped,
                    self.store.url,
                )

    # -- synchronous writes -----------------------------------------------------------------------

    def write_now(self, events: Sequence[AuditEvent]) -> None:
        """Chain and store `events` before returning (``ring-loaded`` and key ring changes).

        Raises:
            AuditError: the store could not be written.
        """
        with self._chain.lock:
            self._append_locked([event_values(e) for e in events])

    def _append_locked(self, values: list[tuple[object, ...]]) -> None:
        rows = self._chain.link_values(values)
        try:
            self.store.append_rows(rows)
        except Exception as exc:
            self._chain.rollback()
            self.write_failures += 1
            self.last_error = str(exc) if isinstance(exc, AuditError) else f"{type(exc).__name__}: {exc}"
            raise AuditError(self.last_error) from None
        with self._drop_lock:
            self.written += len(rows)
        self.last_error = None

    def probe(self) -> bool:
        """Try a read of the store now; True if it answered (readiness checks)."""
        try:
            self.store.count()
        except Exception as exc:
            self.last_error = str(exc)
            return False
        return self.last_error is None

    # -- the writer thread ------------------------------------------------------------------------

    def flush(self, timeout: float = 10.0) -> bool:
        """Write everything queued so far (held items too). True if done within `timeout` seconds.

        Process mode: True once the writer process acknowledged storing everything shipped so far;
        False on timeout, if it died, or if it reports that the store cannot be written."""
        if self._closed or not self._thread.is_alive():
            return False
        deadline = time.monotonic() + timeout
        with self._cond:
            self._flush_requested += 1
            want = self._flush_requested
        self._wake.set()
        with self._cond:
            if not self._cond.wait_for(lambda: self._flush_done >= want, timeout):
                return False
        if self.mode == "thread":
            return True
        child = self._child
        if child is None:
            return self._shipped_all
        return child.wait_acked(child.sent, max(0.0, deadline - time.monotonic())) and self._shipped_all

    def close(self, timeout: float = 10.0) -> None:
        """Flush, stop the writer and close the store (idempotent)."""
        if self._closed:
            return
        self.flush(timeout)
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self._closed = True
        child, self._child = self._child, None
        if child is not None:
            child.close(timeout)
        left = len(self._q)
        if left:
            self._drop(left)
            logger.warning("audit sink closed with %d events unwritten (store %s)", left, self.store.url)
        self.store.close()

    def _run(self) -> None:
        while True:
            idle = not self._q and not self._held and not self._retry and not self._retracts
            self._wake.wait(
                (PROCESS_IDLE_INTERVAL if self.mode == "process" else IDLE_INTERVAL) if idle else self.interval
            )
            self._wake.clear()
            with self._cond:
                flushing = self._flush_requested
            stop = self._stopping
            try:
                self._cycle(final=stop or flushing > self._flush_done)
            except Exception:  # the writer must survive anything; the error is visible in last_error
                logger.exception("audit writer failed")
            with self._cond:
                if not self._q and not self._held and not self._retry and not self._retracts:
                    self._flush_done = max(self._flush_done, flushing)
                    self._cond.notify_all()
                elif self.last_error is not None and flushing > self._flush_done:
                    self._flush_done = flushing  # cannot write now: do not make flush() wait its timeout
                    self._cond.notify_all()
            if stop:
                return

    def _cycle(self, *, final: bool) -> None:
        if self._retry:
            with self._chain.lock:
                try:
                    self._append_locked(self._retry)
                except AuditError:
                    self._log_failure()
                    return
            self._retry = []
        while True:
            retracts = self._take(self._retracts, len(self._retracts))  # before the queue: see retract()
            current = self._take(self._q, min(len(self._q), self.batch))
            held = self._held
            if retracts:
                index = {id(x): x for x in (*held, *current)}
                for target, reason in retracts:
                    found = index.get(id(target))
                    if found is not None:
                        found[OUTCOME], found[REASON] = REJECTED, reason
                    else:  # already written as ok: record the rejection on its own
                        late = list(target)
                        late[OUTCOME], late[REASON], late[TIME] = REJECTED, reason, time.time()
                        current.append(late)
            if final:
                self._write(held + current)
                self._held = []
            else:
                self._write(held)
                self._held = current
            if not final or not self._q:
                return

    @staticmethod
    def _take(q: deque[Any], n: int) -> list[Any]:
        """Pop the `n` oldest entries of `q` (one C-level loop; appends may race in behind them)."""
        return list(starmap(q.popleft, repeat((), n)))

    def _write(self, items: list[list[Any]]) -> None:
        if not items:
            return
        if self.mode == "process":
            for start in range(0, len(items), PROCESS_FRAME):
                self._ship(items[start : start + PROCESS_FRAME])
            return
        inst = instance_id()
        fp_ok = self._fp.fingerprint_canonical
        fp_any = self._fp.fingerprint
        values: list[tuple[object, ...]] = [
            (
                format_ts(x[TIME]),
                inst,
                x[CLIENT],
                x[AUDIENCE],
                x[KID],
                x[OP],
                x[OUTCOME],
                x[REASON],
                None if x[TOKEN] is None else fp_ok(x[TOKEN]) if x[OUTCOME] == OK else fp_any(x[TOKEN]),
                x[GENERATION],
                None if x[DURATION] is None else round(float(x[DURATION]), 3),
            )
            for x in items
        ]
        with self._chain.lock:
            try:
                self._append_locked(values)
            except AuditError:
                self._retry = values
                self._log_failure()

    # -- the writer process (process mode) ---------------------------------------------------------

    _shipped_all = True

    def _ship(self, items: list[list[Any]]) -> None:
        """Send `items` to the writer process, starting one if there is none (or it died)."""
        child = self._child
        if child is None or not child.alive:
            try:
                child = self._child = self._spawn()
            except Exception as exc:  # cannot start a writer: count the batch as dropped
                self.last_error = f"cannot start the audit writer process: {exc}"
                self._lose(len(items), self.last_error)
                self._shipped_all = False
                return
        try:
            child.send(items)
        except OSError:  # died since the check; on_exit counts what it had, this batch is ours
            self._lose(len(items), "the audit writer process has exited")
            self._shipped_all = False
            return
        self._shipped_all = True

    def _spawn(self) -> ChildWriter:
        from mrtr_keys.audit.writer.parent import ChildWriter

        self.children_started += 1
        return ChildWriter(
            self._url,
            self._fp.key_bytes(),
            instance=instance_id(),
            writer=f"{self._chain.writer}/p{self.children_started}",
            on_ack=self._child_ack,
            on_error=self._child_error,
            on_exit=self._child_exit,
        )

    def _child_ack(self, n: int) -> None:
        with self._drop_lock:
            self.written += n
        self.last_error = None

    def _child_error(self, message: str) -> None:
        first = self.last_error != message
        self.last_error = message
        self.write_failures += 1
        if first:
            self._log_failure()

    def _child_exit(self, lost: int, message: str) -> None:
        if self._stopping and not lost:
            return  # close(): the child ended because we closed its pipe
        self.last_error = f"{message}; {lost} events lost" if lost else message
        if lost:
            self._lose(lost, message)
        else:
            logger.warning("%s (store %s); a new one starts with the next batch", message, self.store.url)

    def _lose(self, n: int, why: str) -> None:
        with self._drop_lock:
            self.dropped += n
        logger.warning("audit: %d events dropped: %s (store %s)", n, why, self.store.url)

    def _log_failure(self) -> None:
        logger.warning("audit store write failed (%s); retrying, queue at %d", self.last_error, len(self._q))

    # -- fork ---------------------------------------------------------------------------------------

    def _after_fork_in_child(self) -> None:
        """A forked child is a new instance: new queue, new chain, new thread, new connection
        (and, in process mode, its own writer process on its first batch)."""
        child, self._child = self._child, None
        if child is not None:
            child.forget()
        if self._reopen is not None:
            try:
                self.store = self._reopen()
            except Exception as exc:  # the child keeps running; the sink reports itself unhealthy
                self.last_error = f"cannot reopen the audit store after fork: {exc}"
        self._start()


_open_sinks: dict[tuple[str, str], AuditSink] = {}
_open_lock = threading.Lock()


def shared_sink(
    url: str, directory: str | os.PathLike[str], *, factory: Callable[[], AuditSink] | None = None
) -> AuditSink:
    """The process's one sink for (`url`, audit key `directory`), opened on first use.

    Raises:
        ConfigError, AuditError: the store URL is bad or the store cannot be opened;
            ConfigError: the audit key is unusable.
    """
    key = (url, str(directory))
    with _open_lock:
        sink = _open_sinks.get(key)
        if sink is None or sink._closed:
            if factory is not None:
                sink = factory()
            else:
                from mrtr_keys.audit.fingerprint import load_audit_key
                from mrtr_keys.audit.stores.url import open_store

                fingerprinter = Fingerprinter(load_audit_key(directory))
                sink = AuditSink(
                    open_store(url), fingerprinter, reopen=lambda: open_store(url), mode=writer_mode(), url=url
                )
            _open_sinks[key] = sink
        return sink


def close_all() -> None:
    """Flush and close every sink of this process (registered with `atexit`)."""
    for sink in list(_live):
        try:
            sink.close(timeout=5.0)
        except Exception:  # at exit: log and carry on closing the others
            logger.exception("closing audit sink")
    _open_sinks.clear()


def _after_fork() -> None:
    for sink in list(_live):
        if not sink._closed:
            sink._after_fork_in_child()


atexit.register(close_all)
os.register_at_fork(after_in_child=_after_fork)

__all__ = ["OP_UNSEAL", "AuditSink", "close_all", "shared_sink", "writer_mode"]
