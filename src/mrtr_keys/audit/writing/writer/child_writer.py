"""The parent's handle on one audit writer process (`mrtr_keys.audit.writing.writer.child`).

`ChildWriter` starts ``python -m mrtr_keys.audit.writing.writer.child`` with two pipes, hands it the store
URL and the audit key through its stdin (never argv or the environment), ships batches of sink
items as `marshal` frames of columns (`mrtr_keys.audit.capture.items.to_columns`), and runs one small
thread that reads the child's status frames
(cumulative acknowledgements, or the store's error while it retries) and reaps it when it exits.

The pipe is non-blocking on this side: `send` never blocks its caller (a request thread, when the
sink ships from the submitting thread); what the pipe does not take waits in an outbox that
`drain` writes out (the sink's background thread, which may wait there). The child acknowledges
lazily (when it has caught up, and at least every `mrtr_keys.audit.writing.writer.child.ACK_INTERVAL`), so
this process's status thread wakes a few times a second under load, not once per batch.

When the child dies, the batches shipped to it and not acknowledged are reported to `on_exit` as
lost, less what the store shows it committed from them before it died (`recount`: the dead chain's
length, `mrtr_keys.audit.writing.stores.base.AuditStore.chain_length`), so the count is exact; only if
the store cannot be read then is it an upper bound (the message says so).
"""

from __future__ import annotations

import contextlib
import logging
import marshal
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mrtr_keys.audit.capture.items import AuditItem
from mrtr_keys.audit.writing.writer.child import HEADER, PROTOCOL, SYNC
from mrtr_keys.hardening import child_args

TIME_COLUMN = AuditItem._fields.index("time")
"""Index of the events' POSIX time in a batch's columns."""

logger = logging.getLogger("mrtr_keys.audit")

MODULE = "mrtr_keys.audit.writing.writer.child"
PIPE_BYTES = 1 << 20
"""Requested pipe capacity (Linux ``F_SETPIPE_SZ``; capped by /proc/sys/fs/pipe-max-size)."""

_forgotten: list[subprocess.Popen[bytes]] = []

_PASSED_ENV = frozenset(
    {
        "PATH",
        "HOME",
        "TMPDIR",
        "TZ",
        "LANG",
        "LANGUAGE",
        "USER",
        "LOGNAME",
        "VIRTUAL_ENV",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
    }
)


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The writer process's environment: only what an interpreter needs (``PATH``, locale, ``HOME``,
    ``TMPDIR``, ``PYTHON*``, CA bundle paths). Nothing else is passed on: no ``MRTR_KEYS_AUDIT``
    (a store URL may carry a password), no cloud or Vault credentials. libpq's ``PG*`` variables
    (``PGPASSWORD`` among them) travel through the stdin pipe instead, and the child sets them in
    its own process only (they do not show in its ``/proc/PID/environ``)."""
    return {
        k: v
        for k, v in environ.items()
        if k in _PASSED_ENV or (k.startswith(("LC_", "PYTHON")) and k != "PYTHONSTARTUP")
    }


def package_root() -> str:
    """The directory holding the `mrtr_keys` package (a child process's ``PYTHONPATH``)."""
    here = Path(__file__).resolve()  # src/ (or site-packages/): the parent of the package's own directory
    return str(next(p.parent for p in here.parents if p.name == "mrtr_keys"))


class ChildWriter:
    """One writer process (see the module docstring).

    Args:
        url: the store URL (may carry a password; sent through the pipe only).
        key: the 32-byte audit key. `instance`: the parent's instance id (the events' ``instance``).
        writer: the child's chain id. `on_ack(n)`: n events stored. `on_error(message)`: the store
            cannot be written (the child retries). `on_exit(lost, message)`: the child ended;
            `lost` events were shipped to it and never stored. `recount(writer, since)`: the
            length of chain `writer` in the store counting events at or after POSIX time `since`
            (seconds), or None if the store cannot say; asked once, after the child died, for what
            it stored and did not acknowledge (without it, or on None, `lost` counts all of that).

    Raises:
        OSError: the process cannot be started.
    """

    def __init__(
        self,
        url: str,
        key: bytes,
        *,
        instance: str,
        writer: str,
        on_ack: Callable[[int], None],
        on_error: Callable[[str], None],
        on_exit: Callable[[int, str], None],
        recount: Callable[[str, float], int | None] | None = None,
    ) -> None:
        self.writer = writer
        self._on_ack, self._on_error, self._on_exit = on_ack, on_error, on_exit
        self._recount = recount
        env = child_environment(os.environ)
        root = package_root()
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        libpq = {k: v for k, v in os.environ.items() if k.startswith("PG")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", MODULE, *child_args()],  # it hardens itself unless told core dumps are allowed
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            close_fds=True,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self._w = self._stdin.fileno()
        self._r = self._stdout.fileno()
        with contextlib.suppress(AttributeError, OSError):
            import fcntl

            fcntl.fcntl(self._w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._out = bytearray()
        """Frame bytes the pipe has not taken yet (written by `drain` and the next `send`)."""
        self.sent = 0
        self.acked = 0
        self._stored = 0
        self._stored_at_acked = 0
        """`_stored` when `acked` last advanced: what the child stored beyond it belongs to batches still
        pending (a transaction stored in parts), and is not lost if the child dies."""
        self.error: str | None = None
        self.alive = True
        self._pending: dict[int, tuple[int, float]] = {}
        """Batches shipped and not acknowledged: seq -> (events, earliest event time, POSIX s)."""
        self._errors_seen = 0
        self._progress = time.monotonic()
        """When the child last acknowledged, or when something became pending after nothing was."""
        self.head: tuple[int, str, str] | None = None
        """(seq, hash, time) of the last batch end the child reported stored (`mrtr_keys.audit.verifying.anchor`)."""
        self._write(marshal.dumps((PROTOCOL, url, bytes(key), instance, writer, libpq)))
        os.set_blocking(self._w, False)
        self._thread = threading.Thread(target=self._read_status, name=f"mrtr-keys-audit-status-{writer}", daemon=True)
        self._thread.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __repr__(self) -> str:
        return f"ChildWriter(pid={self.proc.pid}, writer={self.writer!r}, sent={self.sent}, acked={self.acked})"

    # -- shipping ---------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        fd = self._w
        os.write(fd, HEADER.pack(len(data)))
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    @property
    def backlogged(self) -> bool:
        """True while the outbox holds bytes the pipe did not take (the child is behind)."""
        return bool(self._out)

    def send(self, columns: tuple[tuple[Any, ...], ...], n: int) -> int:
        """Ship one batch of `n` items as columns, without blocking: what the pipe does not take
        now stays in the outbox (`backlogged`) for `drain`. Returns its seq.

        Raises:
            OSError: the child is gone and this batch never reached it (the caller still holds it).
                If the child was reaped after the batch was registered, the reaper has counted the
                batch as lost already: then nothing is raised, so it is not counted twice.
            ValueError: a value `marshal` cannot write (a `str` subclass, say); nothing was sent.
        """
        with self._send_lock:
            data = marshal.dumps((self.sent + 1, columns))
            earliest = min(columns[TIME_COLUMN], default=0.0)
            with self._cond:
                if not self.alive:
                    raise BrokenPipeError("the audit writer process has exited")
                self.sent += 1
                seq = self.sent
                if not self._pending:
                    self._progress = time.monotonic()
                self._pending[seq] = (n, earliest)
            try:
                self._push(HEADER.pack(len(data)) + data)
            except OSError:
                with self._cond:
                    counted = self._pending.pop(seq, None) is None  # the reaper summed it into `lost`
                if not counted:
                    raise
            return seq

    def sync(self) -> None:
        """Ask the child to acknowledge as soon as everything sent so far is stored (`wait_acked`
        otherwise waits for its next periodic acknowledgement).

        Raises:
            OSError: the child is gone.
        """
        data = marshal.dumps((SYNC, None))
        with self._send_lock:
            self._push(HEADER.pack(len(data)) + data)

    def _push(self, frame: bytes) -> None:
        """Write `frame` after the outbox; what the pipe does not take joins the outbox (so the
        common case, an empty outbox and room in the pipe, copies nothing)."""
        if self._out:
            self._out += frame
            self._pump()
            return
        try:
            done = os.write(self._w, frame)
        except BlockingIOError:
            done = 0
        if done < len(frame):
            self._out += memoryview(frame)[done:]

    def _pump(self) -> None:
        out, fd = self._out, self._w
        while out:
            try:
                done = os.write(fd, out)
            except BlockingIOError:
                return
            except OSError:
                out.clear()  # the child is gone: its pending batches are counted when it is reaped
                raise
            del out[:done]

    def drain(self, timeout: float) -> bool:
        """Write the outbox, waiting up to `timeout` seconds for the pipe to take it. True once empty.

        Raises:
            OSError: the child is gone.
        """
        deadline = time.monotonic() + timeout
        with self._send_lock:
            while True:
                self._pump()
                left = deadline - time.monotonic()
                if not self._out or left <= 0:
                    return not self._out
                select.select([], [self._w], [], left)

    def silent_for(self) -> float:
        """Seconds the child has acknowledged nothing while batches it was sent wait (0 when none
        waits). A working child acknowledges at least every `mrtr_keys.audit.writing.writer.child.ACK_INTERVAL`
        while busy, so a long silence means the store stopped answering (issue 22)."""
        return time.monotonic() - self._progress if self._pending and self.alive else 0.0

    def wait_acked(self, seq: int, timeout: float) -> bool:
        """Wait until batch `seq` is stored. False on timeout, if the child died, or if it reported
        a store error after this call began (it keeps retrying; do not wait for it)."""
        with self._cond:
            errors = self._errors_seen
            return self._cond.wait_for(
                lambda: self.acked >= seq or not self.alive or self._errors_seen > errors, timeout
            ) and (self.acked >= seq)

    # -- status -----------------------------------------------------------------------------------

    def _read_status(self) -> None:
        buf = bytearray()
        fd = self._r
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            while len(buf) >= 4:
                (n,) = HEADER.unpack_from(buf)
                if len(buf) < 4 + n:
                    break
                seq, count, error, head = marshal.loads(bytes(buf[4 : 4 + n]))  # noqa: S302 - our own child
                del buf[: 4 + n]
                self._status(seq, count, error, head)
        code = self.proc.wait()
        with self._cond:
            self.alive = False
            unacked = list(self._pending.values())
            self._pending.clear()
            stored, in_part = self._stored, self._stored - self._stored_at_acked
            self._cond.notify_all()
        how = f"signal {-code}" if code < 0 else f"status {code}"
        with contextlib.suppress(OSError):
            self._stdout.close()
        lost = max(0, sum(n for n, _ in unacked) - in_part)  # in_part: acknowledged as stored already
        message = f"the audit writer process {self.proc.pid} exited ({how})"
        if lost:
            extra = self._stored_unacked(stored, min(t for _, t in unacked))
            if extra is None:
                message += "; the store could not say what it stored last, so the loss counted is an upper bound"
            elif extra:
                lost -= min(extra, lost)
                self._on_ack(extra)
        self._on_exit(lost, message)

    def _stored_unacked(self, acked: int, since: float) -> int | None:
        """Events the dead child stored after its last acknowledgement (`acked` events in all),
        from the store's count of its chain (`recount`); None if that cannot be known."""
        if self._recount is None:
            return None
        try:
            length = self._recount(self.writer, since)
        except Exception:  # a store error must not stop the reaper
            return None
        return None if length is None else max(0, length - acked)

    def _status(self, seq: int, total: int, error: str | None, head: tuple[int, str, str] | None = None) -> None:
        if head is not None:
            self.head = head
        if error is not None:
            with self._cond:
                self.error = error
                self._errors_seen += 1
                self._cond.notify_all()
            self._on_error(error)
            return
        with self._cond:
            for s in [s for s in self._pending if s <= seq]:
                del self._pending[s]
            if seq > self.acked:
                self.acked, self._stored_at_acked = seq, total
            self._progress = time.monotonic()
            count, self._stored = total - self._stored, max(self._stored, total)
            self.error = None
            self._cond.notify_all()
        if count > 0:
            self._on_ack(count)

    # -- ending -----------------------------------------------------------------------------------

    def close(self, timeout: float) -> bool:
        """Write the outbox, close the pipe (the child stores what it has and exits); kill it after
        `timeout` s. True if it exited by itself."""
        clean = True
        with contextlib.suppress(OSError):
            self.drain(timeout)
        if not self._send_lock.acquire(timeout=timeout):  # a send is stuck: the child stopped reading
            self.proc.kill()
            self._send_lock.acquire()
            clean = False
        try:
            with contextlib.suppress(OSError):
                self._stdin.close()
        finally:
            self._send_lock.release()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            clean = False
        self._thread.join(timeout)
        return clean

    def forget(self) -> None:
        """In a forked child of the parent: drop the inherited pipe ends without touching the
        writer (it still belongs to the parent)."""
        for f in (self._stdin, self._stdout):
            with contextlib.suppress(OSError):
                f.close()
        self.alive = False
        _forgotten.append(self.proc)  # never reaped or waited on here
