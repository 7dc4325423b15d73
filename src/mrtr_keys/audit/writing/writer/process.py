"""`ProcessWriter`: the sink's side of process mode, one `ChildWriter` at a time (restarted when it died)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from mrtr_keys.audit.events import plural
from mrtr_keys.audit.writing.writer.child_writer import ChildWriter

logger = logging.getLogger("mrtr_keys.audit")


class ProcessWriter:
    """The sink's side of process mode: ships item batches to a `ChildWriter`, starting one when
    there is none or the last one died (a new child is a new chain: ``WRITER/pN``), and keeps its
    counts: `written` (events stored), `failures` and `error` (the store cannot be written now).

    Args:
        url: the store URL the child opens (may carry a password; sent through the pipe only).
        key: the audit key. `instance`: the events' ``instance``. `writer`: the sink's chain id.
        lose(n, why): n events will never be stored (the child died with them, or none could be
            started). `where`: the store, for log lines (password removed). `recount`: how far a
            dead child's chain got in the store (`ChildWriter`), so that `lose` is told exactly.
    """

    def __init__(
        self,
        url: str,
        key: bytes,
        instance: str,
        writer: str,
        lose: Callable[[int, str], None],
        where: str,
        recount: Callable[[str, float], int | None] | None = None,
    ) -> None:
        self._url, self._key, self._instance, self._writer = url, key, instance, writer
        self._lose, self._where, self._recount = lose, where, recount
        self.child: ChildWriter | None = None
        self.started = 0
        """Writer processes started (more than 1 means one died and was replaced)."""
        self.shipped_all = True
        """False when the last batch could not be handed to a child (flush() then fails)."""
        self.closing = False
        self.written = 0
        self.failures = 0
        self.error: str | None = None
        self._lock = threading.Lock()
        self._ended: dict[str, tuple[int, str, str]] = {}
        """The last reported heads of children that were replaced (their chains end there)."""

    def _acked(self, n: int) -> None:
        with self._lock:
            self.written += n
        self.error = None

    def _failed(self, message: str) -> None:
        first, self.error = self.error != message, message
        self.failures += 1
        if first:
            logger.warning("audit store write failed (%s); the writer process retries (store %s)", message, self._where)

    def silent_for(self) -> float:
        """Seconds the running child has acknowledged nothing while batches wait (`ChildWriter.silent_for`)."""
        child = self.child
        return child.silent_for() if child is not None else 0.0

    @property
    def pid(self) -> int | None:
        child = self.child
        return child.pid if child is not None and child.alive else None

    @property
    def backlogged(self) -> bool:
        """True while the child's pipe holds back part of a shipped batch (the child is behind)."""
        child = self.child
        return child is not None and child.alive and child.backlogged

    def start(self) -> None:
        """Start the writer process now rather than on the first batch (the sidecar does, so its
        memory is in place before the traffic); a failure is reported like a failed batch."""
        if self.child is None or not self.child.alive:
            self._child()

    def _child(self) -> ChildWriter | None:
        child = self.child
        if child is None or not child.alive:
            try:
                child = self.child = self._spawn()
            except Exception as exc:  # cannot start a writer: said so; the caller loses its batch
                self._failed(f"cannot start the audit writer process: {exc}")
                return None
        return child

    def ship(self, columns: tuple[tuple[Any, ...], ...], n: int) -> bool:
        """Send one batch of `n` items as columns (`mrtr_keys.audit.capture.items.to_columns`) without
        blocking (see `ChildWriter.send`); starts a writer process if there is none.

        Returns False if the writer process had exited and the batch never reached it: the caller
        still holds the items and ships them again (to a new writer). True otherwise, including
        when no writer can be started (the batch is then counted as lost, with the reason).

        Raises:
            ValueError: a value `marshal` cannot write; nothing was sent.
        """
        child = self._child()
        if child is None:
            self._lose(n, self.error or "cannot start the audit writer process")
            self.shipped_all = False
            return True
        try:
            child.send(columns, n)
        except OSError:  # exited before it read this batch: ours to ship again
            return False
        self.shipped_all = True
        return True

    def sync(self) -> None:
        """Ask the running child for an acknowledgement of everything shipped (a flush; see
        `ChildWriter.sync`)."""
        child = self.child
        if child is not None and child.alive:
            try:
                child.sync()
            except OSError:
                pass  # gone: what it had is counted when it is reaped

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the pipe to take every shipped byte. True once it has (or no
        child runs: what it had is counted as lost when it is reaped)."""
        child = self.child
        if child is None or not child.alive:
            return True
        try:
            return child.drain(timeout)
        except OSError:
            return True

    def heads(self) -> dict[str, tuple[int, str, str]]:
        """Chain id -> (seq, hash, time) of the last batch end each child reported stored (the running
        one's and those of children it replaced), for the anchors (`mrtr_keys.audit.verifying.anchor`)."""
        out = dict(self._ended)
        child = self.child
        if child is not None and child.head is not None:
            out[child.writer] = child.head
        return out

    def _spawn(self) -> ChildWriter:
        old = self.child
        if old is not None and old.head is not None:
            self._ended[old.writer] = old.head
        self.started += 1
        return ChildWriter(
            self._url,
            self._key,
            instance=self._instance,
            writer=f"{self._writer}/p{self.started}",
            on_ack=self._acked,
            on_error=self._failed,
            on_exit=self._exited,
            recount=self._recount,
        )

    def _exited(self, lost: int, message: str) -> None:
        if self.closing and not lost:
            return  # close(): the child ended because we closed its pipe
        if lost:  # counted first: whoever reads the error below (unhealthy, "N events lost") reads the count too
            self._lose(lost, message)
        self._failed(f"{message}; {plural(lost, 'event')} lost" if lost else message)

    def wait_acked(self, timeout: float) -> bool:
        """True once everything shipped so far is stored (False on timeout, death or store error)."""
        child = self.child
        if child is None:
            return self.shipped_all
        return child.wait_acked(child.sent, timeout) and self.shipped_all

    def close(self, timeout: float) -> None:
        self.closing = True
        child, self.child = self.child, None
        if child is not None:
            child.close(timeout)

    def forget(self) -> None:
        """In a forked child: drop the inherited child without touching it."""
        child, self.child = self.child, None
        if child is not None:
            child.forget()
