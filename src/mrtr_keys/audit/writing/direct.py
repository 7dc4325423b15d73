"""`DirectWriter`: chains and stores events in the caller's process, on one chain (``host:pid:start#n``).

The sink uses it for synchronous writes (``ring-loaded``, key ring changes) and, in thread mode,
for every batch. A ``ring-loaded`` that could not be written (non-strict) is kept and retried by
the sink's background thread with backoff (`recover`), which doubles as the probe that clears
the store error once the store answers again, so readiness and the promote gate recover without
a restart.

A failed append may have landed (a cut connection loses the answer to a commit the server
applied). Its linked rows are kept "in doubt" and, before the next append, the store says how much
of them it holds (`mrtr_keys.audit.writing.stores.base.stored_prefix`): what landed stays (the rest is
sent), what did not is unlinked; a retry of the same values is then not stored a second time. A
failed batch is stored again in smaller transactions (`mrtr_keys.audit.writing.tx_size`), so a store that is
slow, not down, still takes it. A retry of values a failed append stored in part goes on after that
part, even when other appends came between (the sink's background thread writes a waiting
``ring-loaded`` before it retries its batch).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from mrtr_keys.audit.events import OP_RING_LOADED, AuditEvent, format_ts, instance_id
from mrtr_keys.audit.writing.chain import ChainWriter, event_values
from mrtr_keys.audit.writing.chain_key import ChainKey
from mrtr_keys.audit.writing.stores.base import AuditStore, stored_prefix
from mrtr_keys.audit.writing.tx_size import TransactionSize
from mrtr_keys.errors import AuditError

logger = logging.getLogger("mrtr_keys.audit")

RETRY_MIN, RETRY_MAX = 0.05, 2.0
"""Backoff (seconds) between retries of unrecorded synchronous events and store probes."""
DEFAULT_MOST = 2_000
"""Most events per transaction unless the caller says (the sink passes its batch size)."""
RESUMES_KEPT = 4
"""Failed appends whose stored leading part is remembered, so that a retry of each goes on after it."""


class DirectWriter:
    """Synchronous appends to `store` on chain `writer`, linked with chain key `key` (see the module docstring)."""

    def __init__(
        self, store: AuditStore, writer: str, *, most: int = DEFAULT_MOST, key: ChainKey | None = None
    ) -> None:
        self.store = store
        self.chain = ChainWriter(writer, key)
        self.size = TransactionSize(most)
        """Events per transaction now (`most` until a write fails; `mrtr_keys.audit.writing.tx_size`)."""
        self.error: str | None = None
        """Why the last append or probe failed (None once one succeeded)."""
        self.written = 0
        self.failures = 0
        self.stored_head: tuple[int, str, str] | None = None
        """(seq, hash, time) of the chain's last batch end known stored (`mrtr_keys.audit.verifying.anchor`)."""
        self._loaded: set[tuple[str | None, int]] = set()
        self.unrecorded: list[tuple[tuple[str | None, int], AuditEvent]] = []
        self._count_lock = threading.Lock()
        self._retry_at = 0.0
        self._retry_delay = RETRY_MIN
        self._sync_since: float | None = None
        """Monotonic time a synchronous write (`write_now`) began, None while none is under way."""
        self._doubt: tuple[list[tuple[object, ...]], list[tuple[object, ...]], int] | None = None
        """(linked rows, the values they were cut from, where in them they start) of the last failed
        append, until the store said what it holds."""
        self._resume: list[tuple[list[tuple[object, ...]], int]] = []
        """(values, how many of them are stored) of failed appends that stored a leading part of their
        values, or whose part in doubt another call settled as stored: a retry of the same values goes
        on after that part, whatever other appends came between (`RESUMES_KEPT`, newest last)."""

    def append(self, values: list[tuple[object, ...]]) -> None:
        """Chain value tuples (`FIELDS` order) and store them: in one transaction while writes
        succeed, after a failed one in parts of ``size.now`` (`mrtr_keys.audit.writing.tx_size`: a store too
        slow for the whole batch within its write deadline still takes it). After a failed append,
        the same `values` again are stored once, whether or not the failed part landed, going on
        after the parts already stored (see the module docstring).

        Raises:
            AuditError: the store could not be written (asked again on the next call);
                `AuditUnavailable` if it could not be reached or did not answer in time.
        """
        with self.chain.lock:
            start = 0
            try:
                if self._doubt is not None:
                    self._settle()
                start = self._resumed(values)
                while start < len(values):
                    part = values[start : start + self.size.now]
                    rows = self.chain.link_values(part)
                    self._doubt = (rows, values, start)
                    began = time.monotonic()
                    self.store.append_rows(rows)
                    self.size.stored(time.monotonic() - began)
                    self._doubt = None
                    self._stored(len(rows))
                    start += len(part)
            except Exception as exc:
                if start:  # a leading part of `values` is stored: a retry of them goes on after it
                    self._note(values, start)
                self.failures += 1
                self.size.failed()
                self.error = str(exc) if isinstance(exc, AuditError) else f"{type(exc).__name__}: {exc}"
                raise (type(exc) if isinstance(exc, AuditError) else AuditError)(self.error) from None

    def _settle(self) -> None:
        """Resolve the append in doubt (call with the chain lock held): keep and complete what the
        store holds of it, unlink it if nothing. The values it was cut from are then stored up to
        its end, or up to its start (`_resume`), whatever values the caller passes now."""
        assert self._doubt is not None
        rows, sent, start = self._doubt
        held = stored_prefix(self.store, rows)
        if held == 0:
            self.chain.rollback()
            self._doubt = None
            return
        if held < len(rows):
            self.store.append_rows(rows[held:])
        self._doubt = None
        self._stored(len(rows))
        self._note(sent, start + len(rows))

    def unstored(self, values: list[tuple[object, ...]]) -> tuple[int, bool]:
        """How many of `values`, whose append failed, are not known to be stored, and whether a part of
        them is still in doubt (its commit may have landed; the count is then an upper bound)."""
        with self.chain.lock:
            done = next((d for sent, d in self._resume if sent == values), 0)
            return len(values) - done, self._doubt is not None and self._doubt[1] == values

    def _resumed(self, values: list[tuple[object, ...]]) -> int:
        """How many of `values` a failed append of them stored (0 if none; forgotten once asked)."""
        for i, (sent, done) in enumerate(self._resume):
            if sent == values:
                del self._resume[i]
                return done
        return 0

    def _note(self, values: list[tuple[object, ...]], done: int) -> None:
        """Remember that the first `done` of `values` are stored (see `_resume`)."""
        kept = [r for r in self._resume if r[0] != values]
        kept.append((values, done))
        self._resume = kept[-RESUMES_KEPT:]

    def heads(self) -> dict[str, tuple[int, str, str]]:
        """{chain id: `stored_head`} once a batch is stored (what the service anchors)."""
        head = self.stored_head
        return {} if head is None else {self.chain.writer: head}

    def _stored(self, n: int) -> None:
        with self._count_lock:
            self.written += n
        self.stored_head = self.chain.head
        self.error = None

    def write_now(self, events: Sequence[AuditEvent]) -> None:
        """Chain and store `events` before returning. Raises: AuditError (store not written)."""
        began = time.monotonic()
        self._sync_since = began
        try:
            self.append([event_values(e) for e in events])
        finally:
            if self._sync_since == began:
                self._sync_since = None

    def sync_waiting_for(self) -> float:
        """Seconds a synchronous write (a ``ring-loaded``, a ring change) has waited for the store so far; 0.0
        when none is under way. A store that holds its connections without answering keeps such a write
        until the connection breaks, which can be longer than the write deadline when the write must
        connect first; the sink counts it as silence (`mrtr_keys.audit.capture.sink.SILENT_AFTER`)."""
        since = self._sync_since
        return 0.0 if since is None else time.monotonic() - since

    def ring_loaded(
        self, audience: str | None, generation: int, kid: str | None, *, strict: bool, defer: bool = False
    ) -> bool:
        """Record once per (`audience`, `generation`) that this instance uses that generation.

        Written now unless the store is known to be failing (`defer`, a failed append or probe, or
        events already waiting): then it is kept for `recover` without a try, so a reload never waits
        on a store that is down; a try on a store that just went silent waits at most its write
        deadline. Returns False if it was kept for `recover` (non-strict).

        Raises:
            AuditError: the store cannot be written and `strict` is set.
        """
        key = (audience, generation)
        if key in self._loaded or any(k == key for k, _ in self.unrecorded):
            return True
        event = AuditEvent(
            time=format_ts(time.time()),
            instance=instance_id(),
            op=OP_RING_LOADED,
            audience=audience,
            kid=kid,
            generation=generation,
        )
        try:
            if defer or self.error is not None or self.unrecorded:
                raise AuditError(self.error or "the audit store is not answering")
            self.write_now([event])
        except AuditError as exc:
            if strict:
                raise
            logger.warning("could not record ring-loaded (generation %d) now, will retry: %s", generation, exc)
            self.unrecorded.append((key, event))
            return False
        self._loaded.add(key)
        return True

    def probe(self) -> bool:
        """Read the store now; True if it answered. The error is cleared only when nothing waits to be
        written: no ring-loaded event, no failed append still to settle (a store that answers reads
        may still refuse writes, e.g. SQLite in WAL mode under another writer's lock)."""
        try:
            self.store.count()
        except Exception as exc:
            self.error = str(exc)
            return False
        if not self.unrecorded and self._doubt is None:
            self.error = None
        return True

    def recover(self) -> None:
        """While an append failed or events wait: retry them (or probe), at most once per backoff."""
        if self.error is None and not self.unrecorded:
            return
        now = time.monotonic()
        if now < self._retry_at:
            return
        try:
            if self.unrecorded:
                waiting = self.unrecorded
                self.write_now([e for _, e in waiting])
                self._loaded.update(k for k, _ in waiting)
                self.unrecorded = []
                return
            ok = self.probe()
        except AuditError:
            ok = False
        if ok:
            self._retry_delay = RETRY_MIN
        else:
            self._retry_at = now + self._retry_delay
            self._retry_delay = min(self._retry_delay * 2, RETRY_MAX)
