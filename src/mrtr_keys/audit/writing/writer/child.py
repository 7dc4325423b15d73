"""The audit writer process: fingerprints, chains and stores the batches an `AuditSink` ships to it.

Run as ``python -m mrtr_keys.audit.writing.writer.child`` by `mrtr_keys.audit.writing.writer.child_writer.ChildWriter`
(never by hand). It imports only the audit modules and the store driver it needs (no MCP SDK, no
web framework), so it starts in a few tens of milliseconds.

Protocol (all frames are a 4-byte little-endian length, then `marshal` data; `marshal` is the
stdlib's C serialiser for str/int/float/None/bytes/lists/tuples, read only from our own parent):

* parent -> child, on stdin: first ``(PROTOCOL, url, audit_key, instance, writer, libpq_env)``, then
  batches ``(seq, columns)``: the items (`mrtr_keys.audit.capture.items.AuditItem`) as one tuple per field;
  ``(SYNC, None)`` asks for an acknowledgement as soon as every batch before it is stored (a flush).
  The audit key, the store URL (which may hold a password) and libpq's ``PG*`` variables travel
  only through this inherited pipe, never on the command line or in the environment (the child's
  environment holds only what an interpreter needs: `mrtr_keys.audit.writing.writer.child_writer.child_environment`).
* child -> parent, on its stdout: ``(seq, total, error, head)`` status frames: acknowledgements
  (``seq`` = the newest batch stored, ``total`` = events stored since the child started, ``error``
  None, ``head`` = the chain's head as stored, ``(seq, hash, time)`` of its last batch end, or None
  before the first: what the service anchors, `mrtr_keys.audit.verifying.anchor`), sent at a ``SYNC`` and
  otherwise at most every `ACK_INTERVAL` seconds while something is unacknowledged, so a busy
  parent's status thread wakes a few times a second, not once per batch; ``(0, total, None, head)``
  while a transaction the store could not take whole is stored in parts (progress: `total` events
  stored, no new batch complete; at most every `ACK_INTERVAL`); and ``(0, 0, message, None)`` while
  the store cannot be written (the child retries the same rows, so the chain stays gap-free, and
  meanwhile stops reading, so the parent's queue fills and drops).

The child exits by itself on EOF (the parent closed the pipe or died), after storing every batch
it has read. It ignores SIGINT and SIGTERM (a Ctrl-C in the terminal reaches the whole process
group, and so does systemd's stop with its default ``KillMode=control-group``; the parent decides
when it ends, after flushing). If the parent is gone while the store stays unwritable, it gives up
after `ORPHAN_GIVE_UP` seconds.
"""

from __future__ import annotations

import marshal
import os
import select
import signal
import struct
import sys
import threading
import time
from itertools import chain
from typing import Any

from mrtr_keys.errors import AuditError, ConfigError
from mrtr_keys.hardening import CHILD_FLAG, harden_process
from mrtr_keys.urls import remember, scrub

PROTOCOL = 5
SYNC = -1
"""The seq of a parent's acknowledgement request (a frame ``(SYNC, None)``)."""
HEADER = struct.Struct("<I")
MAX_TX_EVENTS = 2_000
"""Most events per store transaction (queued batches are merged up to this)."""
MAX_FINGERPRINT_CACHE = 1_024
"""Tokens whose fingerprint is kept for the matching unseal (a seal and its unseal in one batch)."""
READ_CHUNK = 1 << 20
MAX_BUFFERED = 1 << 20
"""Bytes read ahead from the pipe before the child stops to write."""
ORPHAN_GIVE_UP = 30.0
ACK_INTERVAL = 0.2
"""Most seconds between acknowledgements while batches keep arriving (seconds)."""
RETRY_MIN, RETRY_MAX = 0.05, 1.0
OVERLAP_SCHEMES = frozenset({"postgresql", "postgres"})
"""Store URL schemes whose appends run in a second thread while the next transaction is built (`main`)."""


class _Frames:
    """Length-prefixed marshal frames from a pipe, read ahead into one buffer."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.eof = False

    def _read(self) -> None:
        chunk = os.read(self.fd, READ_CHUNK)
        if chunk:
            self.buf += chunk
        else:
            self.eof = True

    def _complete(self) -> bool:
        buf = self.buf
        return len(buf) >= 4 and len(buf) >= 4 + HEADER.unpack_from(buf)[0]

    def wait(self, timeout: float) -> bool:
        """True if a frame is buffered complete or the pipe becomes readable within `timeout` s."""
        return self._complete() or self.eof or bool(select.select([self.fd], [], [], timeout)[0])

    def take(self) -> list[Any]:
        """Every complete frame (decoded), blocking until there is at least one or EOF."""
        while not self._complete() and not self.eof:
            self._read()
        while not self.eof and len(self.buf) < MAX_BUFFERED and select.select([self.fd], [], [], 0)[0]:
            self._read()
        out: list[Any] = []
        buf, off = self.buf, 0
        while len(buf) - off >= 4:
            (n,) = HEADER.unpack_from(buf, off)
            if len(buf) - off - 4 < n:
                break
            with memoryview(buf)[off + 4 : off + 4 + n] as view:
                out.append(marshal.loads(view))  # noqa: S302 - only our parent writes this pipe
            off += 4 + n
        del buf[:off]
        return out


def _report(fd: int, seq: int, n: int, error: str | None, head: tuple[int, str, str] | None = None) -> None:
    data = marshal.dumps((seq, n, error, head))
    try:
        os.write(fd, HEADER.pack(len(data)) + data)
    except OSError:  # the parent is gone; carry on storing what we have
        pass


def _describe(exc: BaseException) -> str:
    """The one-line error the parent logs and shows (credentials scrubbed: `mrtr_keys.urls.scrub`)."""
    return str(exc) if isinstance(exc, (AuditError, ConfigError)) else scrub(f"{type(exc).__name__}: {exc}")


_Handed = tuple[int, list[tuple[object, ...]] | None]
"""A unit of the store's work: ``(seq, rows)``, a transaction whose newest batch is `seq`;
``(SYNC, None)``, an acknowledgement request; or `_STOP` (to a store thread: the reader saw EOF)."""
_STOP: _Handed = (0, None)


class _Storer:
    """Links each transaction into the chain and stores it, in the order given, retrying the same
    rows while the store fails; acknowledges as the module docstring says.

    The chain is linked here only, right before the first append that stores it, and the same
    linked rows are re-sent until stored (no other transaction is linked meanwhile), so chain order
    is storage order and a failure leaves no gap, no fork and no duplicate (`_append`).

    A transaction the store did not take is stored again in parts of `size` events (the rule is
    `mrtr_keys.audit.writing.tx_size`), so a store too slow for a whole transaction within its write deadline
    still takes them."""

    def __init__(self, url: str, writer: str, status_fd: int, parent: int, key: bytes) -> None:
        from mrtr_keys.audit.writing.chain import ChainWriter
        from mrtr_keys.audit.writing.chain_key import ChainKey
        from mrtr_keys.audit.writing.tx_size import TransactionSize

        self.url, self.status_fd, self.parent = url, status_fd, parent
        self.links = ChainWriter(writer, ChainKey(key))
        self.store: Any = None
        self.stored = self.acked = self.last_seq = 0
        self.last_ack = 0.0
        self.size = TransactionSize(MAX_TX_EVENTS)

    def ack(self, *, progress: bool = False) -> None:
        """Report what is stored: up to batch `last_seq`, or (`progress`, a transaction stored in parts
        so far) only the events stored, with seq 0 (see the module docstring)."""
        _report(self.status_fd, 0 if progress else self.last_seq, self.stored, None, self.links.head)
        self.acked, self.last_ack = self.stored, time.monotonic()

    def ack_due(self) -> float | None:
        """Seconds until an idle writer should acknowledge (None: everything is acknowledged)."""
        return None if self.acked == self.stored else max(0.0, self.last_ack + ACK_INTERVAL - time.monotonic())

    def handle(self, item: _Handed) -> bool:
        """Store one transaction or answer a ``SYNC``. False if the parent is gone and the store
        stayed unwritable for `ORPHAN_GIVE_UP` seconds (the writer then exits)."""
        seq, rows = item
        if rows is None:
            self.ack()
            return True
        if not self._append(rows):
            return False
        self.last_seq = seq
        if time.monotonic() - self.last_ack >= ACK_INTERVAL:
            self.ack()
        return True

    def finish(self) -> None:
        """Acknowledge what is stored and close the store (at EOF, after the last transaction)."""
        if self.acked < self.stored:
            self.ack()
        if self.store is not None:
            self.store.close()

    def serve(self, slot: _Slot) -> None:
        """The store thread: handle what `slot` hands over until `_STOP` (see `main`)."""
        status = 1  # unless it stops as asked
        try:
            while True:
                item = slot.get(self.ack_due())
                if item is None:  # caught up, and nothing came within the ack interval
                    self.ack()
                elif item is _STOP:
                    break
                elif not self.handle(item):
                    return
            self.finish()
            status = 0
        finally:
            slot.end(status)

    def _append(self, rows: list[tuple[object, ...]]) -> bool:
        """Store `rows` in transactions of at most ``size.now`` events, each linked once, retrying while
        the store fails. A failed append may have landed (the answer to a commit lost with its
        connection): before each retry the store says how much of it it holds (`stored_prefix`), and
        only the rest is sent, so a retried transaction is stored exactly once and the chain keeps
        no duplicate (issue 22). One the store holds none of, and that is larger than ``size.now``, is
        unlinked (`ChainWriter.rollback`) and linked again as a smaller first part."""
        from mrtr_keys.audit.writing.stores.base import stored_prefix
        from mrtr_keys.audit.writing.stores.url import open_store

        delay, failing_since = RETRY_MIN, 0.0
        done = 0  # rows of `rows` stored
        linked: list[tuple[object, ...]] | None = None  # the transaction being stored
        in_doubt = False  # an append of `linked` was tried and failed
        while done < len(rows):
            try:
                if self.store is None:
                    self.store = open_store(self.url)
                held = 0
                if linked is not None and in_doubt:
                    held = stored_prefix(self.store, linked)
                    if held == 0 and len(linked) > self.size.now:
                        self.links.rollback()
                        linked = None
                if linked is None:
                    linked = self.links.link_rows(rows[done : done + self.size.now])
                in_doubt = True
                began = time.monotonic()
                self.store.append_rows(linked[held:])
                self.size.stored(time.monotonic() - began)
                done += len(linked)
                self.stored += len(linked)
                linked, in_doubt = None, False
                if done < len(rows) and time.monotonic() - self.last_ack >= ACK_INTERVAL:
                    self.ack(progress=True)
                delay, failing_since = RETRY_MIN, 0.0
            except Exception as exc:
                _report(self.status_fd, 0, 0, _describe(exc))
                self.size.failed()
                now = time.monotonic()
                failing_since = failing_since or now
                if os.getppid() != self.parent and now - failing_since > ORPHAN_GIVE_UP:
                    print(
                        f"mrtr-keys audit writer: parent gone, giving up on {len(rows) - done} events", file=sys.stderr
                    )
                    return False
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
        return True


class _Slot:
    """Where a built transaction waits for the store thread: at most one item; `ended` is set (with
    the thread's exit status) when the store thread stops, after which nothing more is taken."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._item: _Handed | None = None
        self.ended: int | None = None

    def wait_free(self) -> bool:
        """Block until the slot is empty (the store thread took the last item). False if it ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._item is None or self.ended is not None)
            return self.ended is None

    def put(self, item: _Handed) -> bool:
        """Hand `item` over once the slot is empty. False if the store thread has ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._item is None or self.ended is not None)
            if self.ended is not None:
                return False
            self._item = item
            self._cond.notify_all()
            return True

    def get(self, timeout: float | None) -> _Handed | None:
        """The next item, waiting at most `timeout` seconds (None: without limit); None on timeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._item is not None, timeout):
                return None
            item, self._item = self._item, None
            self._cond.notify_all()
            return item

    def end(self, status: int) -> None:
        with self._cond:
            self.ended = status
            self._cond.notify_all()


def main() -> int:
    """Serve one parent until EOF (see the module docstring). Returns the exit status.

    This thread reads frames, fingerprints and builds the rows of each transaction; a `_Storer`
    links and stores them, in order. For PostgreSQL (`OVERLAP_SCHEMES`) it does so in a second
    thread while this one builds the next transaction: its append mostly waits for the server,
    with the interpreter lock released. SQLite and JSONL appends run here: they hold the lock
    for most of their time (binding every value), and handing them to another thread only added
    CPU time (docs/audit.md). At most one transaction is being stored and one built or waiting;
    while the store fails, the reader stops at the handover and stops reading.
    """
    harden_process(allow_core_dumps=CHILD_FLAG in sys.argv[1:])  # before the audit key arrives
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    status_fd = os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the status pipe
    parent = os.getppid()
    frames = _Frames(0)
    first = frames.take()
    if not first:
        return 0
    hello = first.pop(0)
    if hello[0] != PROTOCOL:
        _report(status_fd, 0, 0, f"audit writer protocol {hello[0]} is not {PROTOCOL}")
        return 2
    _, url, key, instance, writer, libpq = hello
    os.environ.update(libpq)  # for libpq only; not in this process's /proc/PID/environ
    remember(url)

    from mrtr_keys.audit.capture.items import item_rows
    from mrtr_keys.audit.writing.fingerprint import Fingerprinter

    fingerprinter = Fingerprinter(key)
    storer = _Storer(url, writer, status_fd, parent, key)
    del key
    slot: _Slot | None = None
    if url.partition(":")[0].lower() in OVERLAP_SCHEMES:
        slot = _Slot()
        thread = threading.Thread(target=storer.serve, args=(slot,), name="mrtr-keys-audit-store", daemon=True)
        thread.start()
    hand = storer.handle if slot is None else slot.put
    cache: dict[str, str] = {}
    pending = first
    next_seq = 1  # of the next row: every transaction is stored, in order, or the writer exits
    while True:
        if not pending:
            if frames.eof:
                break
            if slot is None:
                due = storer.ack_due()
                if due is not None and not frames.wait(due):
                    storer.ack()  # caught up, and nothing came within the ack interval
            else:
                while not frames.wait(1.0):
                    if slot.ended is not None:
                        return slot.ended
            pending = frames.take()
            continue
        # Merge queued batches into transactions of at most MAX_TX_EVENTS events (`_Storer.size`).
        seq, columns = pending.pop(0)
        if seq == SYNC:
            if not hand((SYNC, None)):
                return 1
            continue
        batch = [columns]
        n, most = len(columns[0]), storer.size.now  # smaller while the store cannot take full ones
        while pending and pending[0][0] != SYNC and n + len(pending[0][1][0]) <= most:
            seq, columns = pending.pop(0)
            batch.append(columns)
            n += len(columns[0])
        if len(cache) > MAX_FINGERPRINT_CACHE:  # bounded: this many + one transaction's tokens of <= CACHE_TOKEN_CHARS
            cache.clear()
        if slot is not None and not slot.wait_free():  # build once the previous one is being stored
            return 1
        items = chain.from_iterable(zip(*c, strict=True) for c in batch)
        values = item_rows(items, instance, fingerprinter, cache, writer, next_seq)
        next_seq += len(values)
        if not hand((seq, values)):
            return 1
    if slot is None:
        storer.finish()
        return 0
    slot.put(_STOP)
    thread.join()
    return slot.ended or 0


if __name__ == "__main__":
    sys.exit(main())
