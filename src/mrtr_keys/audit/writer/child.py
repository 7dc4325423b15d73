"""The audit writer process: fingerprints, chains and stores the batches an `AuditSink` ships to it.

Run as ``python -m mrtr_keys.audit.writer.child`` by `mrtr_keys.audit.writer.parent.ChildWriter`
(never by hand). It imports only the audit modules and the store driver it needs (no MCP SDK, no
web framework), so it starts in a few tens of milliseconds.

Protocol (all frames are a 4-byte little-endian length, then `marshal` data; `marshal` is the
stdlib's C serialiser for str/int/float/None/bytes/lists/tuples, read only from our own parent):

* parent -> child, on stdin: first ``(PROTOCOL, url, audit_key, instance, writer, libpq_env)``, then
  batches ``(seq, columns)``: the items (`mrtr_keys.audit.items.AuditItem`) as one tuple per field;
  ``(SYNC, None)`` asks for an acknowledgement as soon as every batch before it is stored (a flush).
  The audit key, the store URL (which may hold a password) and libpq's ``PG*`` variables travel
  only through this inherited pipe, never on the command line or in the environment (the child's
  environment holds only what an interpreter needs: `mrtr_keys.audit.writer.parent.child_environment`).
* child -> parent, on its stdout: ``(seq, total, error)`` status frames: acknowledgements
  (``seq`` = the newest batch stored, ``total`` = events stored since the child started, ``error``
  None), sent at a ``SYNC`` and otherwise at most every `ACK_INTERVAL` seconds while something
  is unacknowledged, so a busy parent's status thread wakes a few times a second, not once per
  batch; and ``(0, 0, message)`` while the store cannot be written (the child retries the same rows, so the
  chain stays gap-free, and meanwhile stops reading, so the parent's queue fills and drops).

The child exits by itself on EOF (the parent closed the pipe or died), after storing every batch
it has read. It ignores SIGINT (a Ctrl-C in the terminal reaches the whole process group; the
parent decides when it ends). If the parent is gone while the store stays unwritable, it gives up
after `ORPHAN_GIVE_UP` seconds.
"""

from __future__ import annotations

import marshal
import os
import select
import signal
import struct
import sys
import time
from itertools import chain
from typing import Any

PROTOCOL = 3
SYNC = -1
"""The seq of a parent's acknowledgement request (a frame ``(SYNC, None)``)."""
HEADER = struct.Struct("<I")
MAX_TX_EVENTS = 2_000
"""Most events per store transaction (queued batches are merged up to this)."""
MAX_FINGERPRINT_CACHE = 4_096
"""Tokens whose fingerprint is kept for the matching unseal (a seal and its unseal in one batch)."""
READ_CHUNK = 1 << 20
MAX_BUFFERED = 1 << 20
"""Bytes read ahead from the pipe before the child stops to write."""
ORPHAN_GIVE_UP = 30.0
ACK_INTERVAL = 0.2
"""Most seconds between acknowledgements while batches keep arriving (seconds)."""
RETRY_MIN, RETRY_MAX = 0.05, 1.0


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


def _report(fd: int, seq: int, n: int, error: str | None) -> None:
    data = marshal.dumps((seq, n, error))
    try:
        os.write(fd, HEADER.pack(len(data)) + data)
    except OSError:  # the parent is gone; carry on storing what we have
        pass


def _describe(exc: BaseException) -> str:
    from mrtr_keys.errors import AuditError, ConfigError

    return str(exc) if isinstance(exc, (AuditError, ConfigError)) else f"{type(exc).__name__}: {exc}"


def main() -> int:
    """Serve one parent until EOF (see the module docstring). Returns the exit status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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

    from mrtr_keys.audit.chain import ChainWriter
    from mrtr_keys.audit.fingerprint import Fingerprinter
    from mrtr_keys.audit.items import item_rows
    from mrtr_keys.audit.stores.url import open_store

    fingerprinter = Fingerprinter(key)
    del key
    links = ChainWriter(writer)
    store: Any = None
    cache: dict[str, str] = {}
    pending = first
    stored, acked, last_seq, last_ack = 0, 0, 0, 0.0

    def ack() -> None:
        nonlocal acked, last_ack
        _report(status_fd, last_seq, stored, None)
        acked, last_ack = stored, time.monotonic()

    while True:
        if not pending:
            if frames.eof:
                break
            if acked < stored and not frames.wait(last_ack + ACK_INTERVAL - time.monotonic()):
                ack()  # caught up, and nothing came within the ack interval
            pending = frames.take()
            continue
        # Merge queued batches into transactions of at most MAX_TX_EVENTS events.
        seq, columns = pending.pop(0)
        if seq == SYNC:
            ack()
            continue
        batch = [columns]
        n = len(columns[0])
        while pending and pending[0][0] != SYNC and n + len(pending[0][1][0]) <= MAX_TX_EVENTS:
            seq, columns = pending.pop(0)
            batch.append(columns)
            n += len(columns[0])
        if len(cache) > MAX_FINGERPRINT_CACHE:  # bounded memory: ~4k tokens of at most 64 KiB chars
            cache.clear()
        items = chain.from_iterable(zip(*c, strict=True) for c in batch)
        values = item_rows(items, instance, fingerprinter, cache, writer, links.seq + 1)
        delay, failing_since = RETRY_MIN, 0.0
        while True:
            try:
                if store is None:
                    store = open_store(url)
                rows = links.link_rows(values)
                try:
                    store.append_rows(rows)
                except BaseException:
                    links.rollback()
                    raise
                break
            except Exception as exc:
                _report(status_fd, 0, 0, _describe(exc))
                now = time.monotonic()
                failing_since = failing_since or now
                if os.getppid() != parent and now - failing_since > ORPHAN_GIVE_UP:
                    print(f"mrtr-keys audit writer: parent gone, giving up on {len(values)} events", file=sys.stderr)
                    return 1
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
        stored += len(values)
        last_seq = seq
        if time.monotonic() - last_ack >= ACK_INTERVAL:
            ack()
    if acked < stored:
        ack()
    if store is not None:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
