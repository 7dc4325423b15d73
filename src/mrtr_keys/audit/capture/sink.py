"""The audit sink: a queue bounded in events and bytes, drained in the background into a store.

The caller's side (`submit`) cuts the token to the token cap, takes one short lock and appends
an `AuditItem`: no hashing, no I/O. Two writers (``mode``):

* ``"process"`` (the default of `mrtr_keys.audit.capture.registry.shared_sink`, so of in-process codecs,
  the sidecar and the CLI): queued items travel as `marshal` frames of columns through a pipe
  (`mrtr_keys.audit.writing.writer.child_writer`), shipped mostly by the submitting thread itself and otherwise
  by a background thread that wakes rarely (`mrtr_keys.audit.capture.shipper`). A child process
  (`mrtr_keys.audit.writing.writer.child`, started on the first batch or by `start_writer`, restarted on
  the next batch after it died) fingerprints, chains and stores, on its own interpreter lock and
  CPU, and acknowledges what it stored.
* ``"thread"``: the writer thread wakes every `interval` (50 ms), fingerprints, chains and appends here.

The queue (`mrtr_keys.audit.capture.queue.AuditQueue`) is bounded in events and bytes; past its
high-water mark it slows callers instead of dropping (see there). A failed write is retried with
the same batch (the chain stays gap-free). `healthy` is False while writes fail, the store is silent or the
writer process died (the sidecar's /readyz and strict mode use it); events shipped to a process
that died before storing them count as dropped (exactly: the store is asked how far its chain got).

A rejection the MCP SDK reports just after our codec unsealed a token (`mrtr_keys.audit.capture.sdk_capture`)
replaces that ``unseal ok`` item in the queue with one ``unseal rejected`` event carrying the SDK's
reason (`retract`); only if the item already left the queue is the rejection an event of its own.
Synchronous writes (`write_now`, `ring_loaded`) happen in the caller's process, on the sink's own chain.
Every sink is closed at interpreter exit and renewed in a forked child (`mrtr_keys.audit.capture.live`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

from mrtr_keys.audit.capture.items import AuditItem, item_values
from mrtr_keys.audit.capture.live import close_all
from mrtr_keys.audit.capture.live import sinks as live
from mrtr_keys.audit.capture.queue import DEFAULT_CAPACITY, DEFAULT_MAX_BYTES, DEFAULT_MAX_WAIT, AuditQueue
from mrtr_keys.audit.capture.shipper import SHIP_DELAY, Shipper
from mrtr_keys.audit.events import OK, AuditEvent, format_ts, instance_id
from mrtr_keys.audit.writing import switch
from mrtr_keys.audit.writing.direct import DirectWriter
from mrtr_keys.audit.writing.fingerprint import Fingerprinter
from mrtr_keys.audit.writing.stores.base import AuditStore
from mrtr_keys.audit.writing.writer.process import ProcessWriter
from mrtr_keys.errors import AuditError

logger = logging.getLogger("mrtr_keys.audit")

DEFAULT_BATCH = 2_000
DEFAULT_INTERVAL = 0.05
"""Seconds between writer wake-ups (thread mode)."""
PROCESS_INTERVAL = SHIP_DELAY
"""Shortest sleep of the process-mode background thread (seconds; see `mrtr_keys.audit.capture.shipper`)."""
FINAL_WAIT = 5.0
"""Seconds a flush or close waits for a full pipe to take the last frames."""
Mode = Literal["thread", "process"]
SILENT_AFTER = 1.0
"""Seconds a store may leave shipped events unacknowledged, or a synchronous write waiting, before it counts as down
(`healthy` False, so strict mode refuses and ``/readyz`` fails): its write deadline for readiness (docs/audit.md)."""
IDLE_INTERVAL = 0.5  # seconds between thread-mode wake-ups while nothing is queued (an idle sink costs almost nothing)

_writer_ids = itertools.count(1)


class AuditSink:
    """Queue + background writer for one store (see the module docstring).

    Args:
        store: an open `AuditStore` (the sink owns and closes it; process mode uses it for
            `write_now` and reads, and the child opens its own connection).
        fingerprinter: fingerprints tokens (thread mode), or hands its key to the child.
        capacity: hard bound in events; `max_bytes`: hard bound in bytes; `max_wait`: seconds a caller may be
            slowed at the high-water mark; `batch`: most events per write (thread mode); `interval`: writer
            period (s; default 0.05; a process-mode background thread's shortest sleep).
        mode: ``"thread"`` or ``"process"`` (see the module docstring).
        url: the store URL the child opens (process mode; default `store.url`, which has any password
            removed, so pass the real one for a password-protected PostgreSQL).
        chain_key: links batches (default: from the audit key; ConfigError: `audit.writing.switch.writer_key`).
    """

    def __init__(
        self,
        store: AuditStore,
        fingerprinter: Fingerprinter,
        *,
        capacity: int = DEFAULT_CAPACITY,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_wait: float = DEFAULT_MAX_WAIT,
        batch: int | None = None,
        interval: float | None = None,
        reopen: Callable[[], AuditStore] | None = None,
        mode: Mode = "thread",
        url: str | None = None,
        chain_key: switch.ChainKey | None = None,
    ) -> None:
        if mode not in ("thread", "process"):
            raise ValueError("mode must be 'thread' or 'process'")
        process = mode == "process"
        batch = batch if batch is not None else DEFAULT_BATCH
        interval = interval if interval is not None else PROCESS_INTERVAL if process else DEFAULT_INTERVAL
        if batch < 1 or not interval > 0:
            raise ValueError("batch must be >= 1, interval > 0")
        self.store = store
        self.mode: Mode = mode
        self._new_queue = functools.partial(AuditQueue, capacity=capacity, max_bytes=max_bytes, max_wait=max_wait)
        self._new_queue(healthy=bool, wake=_nothing, where="")  # refuses bad bounds now
        self.batch = batch
        self.interval = interval
        self._url = url or store.url
        self._fp = fingerprinter
        self.chain_key = switch.writer_key(store, fingerprinter.key_bytes(), chain_key)
        self._reopen = reopen
        self._start()
        live.add(self)

    def _start(self) -> None:
        self._wake = threading.Event()
        self.queue = q = self._new_queue(healthy=lambda: self.healthy, wake=self._wake.set, where=self.store.url)
        self.submit = q.submit
        """Queue one `AuditItem` (`AuditQueue.submit`: slowed past the high-water mark; never raises)."""
        self.submit_many = q.submit_many
        """Queue a list of `AuditItem` in order under one lock (`AuditQueue.submit_many`)."""
        writer = f"{instance_id()}#{next(_writer_ids)}"
        self._direct = DirectWriter(self.store, writer, most=self.batch, key=self.chain_key)
        self._cond = threading.Condition()
        self._flush_requested = 0
        self._flush_done = 0
        self._stopping = False
        self._closed = False
        self._retry: list[tuple[object, ...]] = []
        self._appending = threading.Lock()
        """Thread mode: held by the background thread from taking a batch to settling `_retry`, and by
        close() while it counts what is left, so that a close() that stopped waiting for the thread
        counts a batch after its append ended (once: written, or dropped), and the thread stores
        nothing after that."""
        self._down_at: float | None = None
        self._process = (
            ProcessWriter(
                self._url, self._fp.key_bytes(), instance_id(), self.writer, q.drop, self.store.url, self._chain_length
            )
            if self.mode == "process"
            else None
        )
        self._shipper = Shipper(q, self._process, self._wake.set, self.interval) if self._process is not None else None
        self._thread = threading.Thread(
            target=self._run, name=f"mrtr-keys-audit-{self._direct.chain.writer}", daemon=True
        )
        q.writer_thread = self._thread
        self._thread.start()

    def retract(self, item: AuditItem, reason: str) -> None:
        """Turn queued ``unseal ok`` `item` into ``unseal rejected`` with `reason` (SDK capture): in
        place while it is queued, else (it already left) as a rejection event of its own."""
        if not self.queue.replace(item, item.rejected(reason)):
            self.submit(item.rejected(reason, time.time()))

    def start_writer(self) -> None:
        """Start the writer process now (process mode; else nothing): the sidecar does at start,
        so the writer's memory is in place before traffic arrives."""
        if self._process is not None:
            self._process.start()

    def __repr__(self) -> str:
        return f"AuditSink({self.store.url!r}, mode={self.mode}, queued={self.queued}, dropped={self.dropped})"

    @property
    def writer(self) -> str:
        """This sink's chain id (``host:pid:start#n``)."""
        return self._direct.chain.writer

    @property
    def child_pid(self) -> int | None:
        """The writer process's pid while it runs (process mode), else None."""
        return self._process.pid if self._process is not None else None

    @property
    def children_started(self) -> int:
        """Writer processes started (process mode; more than 1 means one died and was replaced)."""
        return self._process.started if self._process is not None else 0

    @property
    def queued(self) -> int:
        """Events held (queued, or being handed to the writer)."""
        return self.queue.n

    @property
    def dropped(self) -> int:
        """Events that will never be stored: dropped at the hard bound, or lost with a writer process."""
        return self.queue.dropped

    def _silent_for(self) -> float:
        return self._process.silent_for() if self._process is not None else 0.0

    @property
    def last_error(self) -> str | None:
        """Why the store cannot be written now (None while it can)."""
        error = self._direct.error or (self._process.error if self._process is not None else None)
        if error is None and (silent := self._silent_for()) > SILENT_AFTER:
            error = f"the audit store has acknowledged no write for {silent:.1f} s (store {self.store.url})"
        if error is None and (waiting := self._direct.sync_waiting_for()) > SILENT_AFTER:  # a ring-loaded, say
            error = f"the audit store has not answered a write for {waiting:.1f} s (store {self.store.url})"
        return error

    @property
    def healthy(self) -> bool:
        """False while the last write to the store failed, while the store has acknowledged nothing for
        `SILENT_AFTER` seconds with events waiting or a synchronous write (``ring-loaded``, a ring change)
        waiting (a silent store), or after the writer process died (until a new one has stored a batch)."""
        healthy = self.last_error is None and not self._closed
        if healthy:
            self._down_at = None
        elif self._down_at is None:
            self._down_at = time.time() - max(self._silent_for(), self._direct.sync_waiting_for())
        return healthy

    @property
    def down_since(self) -> float | None:
        """POSIX time since which the store counts as down (None while `healthy`)."""
        return None if self.healthy else self._down_at

    @property
    def written(self) -> int:
        """Events stored (acknowledged by the writer process, or written here)."""
        return self._direct.written + (self._process.written if self._process is not None else 0)

    @property
    def write_failures(self) -> int:
        return self._direct.failures + (self._process.failures if self._process is not None else 0)

    @property
    def slowed(self) -> int:
        """Callers made to wait at the queue's high-water mark."""
        return self.queue.slowed

    def status(self) -> dict[str, object]:
        """``healthy``, ``down_since`` (ISO time or None), ``queued``, ``dropped``, ``slowed`` and
        ``error`` (the sidecar's /readyz shows it to authenticated callers)."""
        since = self.down_since
        return {
            "healthy": since is None,
            "down_since": None if since is None else format_ts(since),
            "queued": self.queued,
            "dropped": self.dropped,
            "slowed": self.slowed,
            "error": self.last_error,
        }

    @property
    def congested(self) -> bool:
        """True while the queue is past its high-water mark (strict callers refuse then)."""
        return self.queue.congested

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
        fingerprinted, by the writer, and never stored."""
        self.submit(AuditItem(op, outcome, kid, token, reason, time.time(), audience, generation, client, duration_ms))

    # -- synchronous writes -----------------------------------------------------------------------

    def write_now(self, events: Sequence[AuditEvent]) -> None:
        """Chain and store `events` in this process before returning (key ring changes).

        Raises:
            AuditError: the store could not be written.
        """
        self._direct.write_now(events)

    def ring_loaded(self, audience: str | None, generation: int, kid: str | None, *, strict: bool = False) -> None:
        """Record, once per (`audience`, `generation`) in this process, that this instance now uses
        key ring `generation` (primary `kid`); the promote gate relies on it. Written before this
        returns while the store answers; while it is down (`healthy` False) not tried at all, so the
        caller (a reload, after the switch) never waits on it.

        If the store cannot be written: with `strict`, raises `AuditError`; else the event is kept
        and written by the background thread as soon as the store is back.
        """
        defer = not self.healthy
        if not self._direct.ring_loaded(audience, generation, kid, strict=strict, defer=defer):
            self._wake.set()

    def heads(self) -> dict[str, tuple[int, str, str]]:
        """Chain id -> (seq, hash, time) of the last batch end stored of each chain it writes (`audit.anchor`)."""
        return {**(self._process.heads() if self._process is not None else {}), **self._direct.heads()}

    def probe(self) -> bool:
        """Try a read of the store now; True if it answered and nothing else is failing."""
        return self._direct.probe() and self.healthy

    # -- the background thread --------------------------------------------------------------------

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
        if self._process is None:
            return self._direct.error is None
        return self._process.wait_acked(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float = 10.0) -> None:
        """Flush, stop the writer and close the store (idempotent)."""
        if self._closed:
            return
        self.flush(timeout)
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self._closed = True
        self.queue.wake_all()
        if self._process is not None:
            self._process.close(timeout)
        with self._appending:  # waits for an append the thread is still in (it stores nothing after this)
            left = self.queue.n
            if left:
                self.queue.drop(left)
                logger.warning("audit sink closed with %d events unwritten (store %s)", left, self.store.url)
            if self._retry:  # thread mode: a batch the store did not take, out of the queue already
                failed, in_doubt = self._direct.unstored(self._retry)
                self._retry = []
                if failed:
                    bound = "; a part of them may have been stored, so the count is an upper bound" if in_doubt else ""
                    self.queue.drop(failed, f"the sink closed while the store could not write them{bound}")
        self.store.close()

    def _chain_length(self, writer: str, since: float) -> int:
        """How many events chain `writer` stored, counting those at or after POSIX time `since`
        (the process writer asks when a child died; a store error there keeps its count an upper
        bound). A stored time is its event's truncated to the microsecond: hence 1 ms of slack."""
        return self.store.chain_length(writer, format_ts(max(0.0, since - 0.001)))

    def _idle(self) -> bool:
        return not self.queue.items and not self._retry and not (self._shipper is not None and self._shipper.backlogged)

    def _run(self) -> None:
        wait = self.interval
        while True:
            if self._shipper is None:
                idle = self._idle() and not self._direct.unrecorded
                wait = IDLE_INTERVAL if idle else self.interval
            elif self._direct.unrecorded:
                wait = min(wait, self.interval)
            self._wake.wait(wait)
            self._wake.clear()
            with self._cond:
                flushing = self._flush_requested
            stop = self._stopping
            final = stop or flushing > self._flush_done
            try:
                self._direct.recover()
                if self._shipper is not None:
                    found = len(self.queue.items)
                    self._shipper.ship_all(FINAL_WAIT if final else self.interval, final=final)
                    wait = self._shipper.next_wait(found)
                else:
                    self._cycle(final=final)
            except Exception:  # the writer must survive anything; the error is visible in last_error
                logger.exception("audit writer failed")
            with self._cond:
                if self._idle():
                    self._flush_done = max(self._flush_done, flushing)
                    self._cond.notify_all()
                elif (self.last_error is not None or final) and flushing > self._flush_done:
                    self._flush_done = flushing  # cannot write it all now: do not make flush() wait its timeout
                    self._cond.notify_all()
            if stop:
                return

    def _cycle(self, *, final: bool) -> None:
        """Thread mode: append up to `batch` queued items (all of them when `final`)."""
        with self._appending:
            if self._closed:  # close() counted what is left
                return
            if self._retry:
                try:
                    self._direct.append(self._retry)
                except AuditError:
                    self._log_failure()
                    return
                self._retry = []
        while True:
            self._write()
            if not final or not self.queue.items or self._retry or self._closed:
                return

    def _write(self) -> None:
        with self._appending:
            if self._closed:
                return
            items = self.queue.take(self.batch)
            if not items:
                return
            values = item_values(items, instance_id(), self._fp)
            self.queue.release(items)
            try:
                self._direct.append(values)
            except AuditError:
                self._retry = values
                self._log_failure()

    def _log_failure(self) -> None:
        logger.warning("audit store write failed (%s); retrying, %d events held", self.last_error, self.queue.n)

    # -- fork ---------------------------------------------------------------------------------------

    def after_fork_in_child(self) -> None:
        """A forked child is a new instance: new queue, new chain, new thread, new connection
        (and, in process mode, its own writer process on its first batch)."""
        if self._process is not None:
            self._process.forget()
        error = None
        if self._reopen is not None:
            try:
                self.store = self._reopen()
            except Exception as exc:  # the child keeps running; the sink reports itself unhealthy
                error = f"cannot reopen the audit store after fork: {exc}"
        self._start()
        self._direct.error = error


def _nothing() -> None:
    pass


__all__ = ["AuditItem", "AuditSink", "close_all", "live"]
