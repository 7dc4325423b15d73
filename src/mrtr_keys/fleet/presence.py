"""Presence: every instance says, in the audit store, which key ring generation it has loaded.

An instance (a process serving tokens: an MCP server using a codec from
`mrtr_keys.request_state_security`, or a sidecar) has a name: ``instance=`` / ``--instance`` /
``MRTR_KEYS_INSTANCE``, default ``host:pid`` (in Kubernetes, the pod name through the downward
API). It writes a heartbeat every `DEFAULT_HEARTBEAT` seconds into the audit store's presence table
(`mrtr_keys.audit.writing.stores.base.INSTANCE_COLUMNS`: generation loaded, primary kid, codec type, package
version, ...), one row a name replaced each time; at once when it starts and whenever it loads a new
generation; and a ``stopped`` row on a clean shutdown (SIGTERM, interpreter exit, or when every codec
it reported on is gone).

An instance is **live** while its last heartbeat is younger than `LIVE_INTERVALS` of its own intervals,
**stale** after that (it crashed or cannot reach the store: it stops counting), and **stopped** at once
after a clean shutdown. A live instance whose ring watcher is stuck says so in its note (``watcher stuck
since ...``, `mrtr_keys.keystores.watch.RingWatcher.stuck_note`). The rotation gates
(`mrtr_keys.fleet.gates`) and ``mrtr-keys fleet status`` read this. Heartbeat times come from an
injectable clock, so tests of liveness never sleep.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import textwrap
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING, Any

from mrtr_keys.audit.events import format_ts
from mrtr_keys.errors import AuditError
from mrtr_keys.fleet.instances import (
    DEFAULT_HEARTBEAT,
    ENV_INSTANCE,
    LIVE,
    LIVE_INTERVALS,
    RUNNING,
    STALE,
    STOPPED,
    InstanceRecord,
    Loaded,
    Source,
    check_heartbeat,
    instance_name,
    read_instances,
)
from mrtr_keys.fleet.usage import UsageReporter, release, reporter_for
from mrtr_keys.keystores.watch import STUCK_NOTE
from mrtr_keys.version import __version__

if TYPE_CHECKING:
    from mrtr_keys.audit.writing.stores.base import AuditStore
    from mrtr_keys.keystores.watch import RingWatcher

log = logging.getLogger("mrtr_keys.presence")

CHANGE_POLL = 0.5
"""Seconds between looks at what the sources have loaded (in memory; a change is written at once)."""
NOTE_CHARS = 300
"""Longest presence note kept (shortened at a word boundary, never mid-word)."""
STOP_TIMEOUT = 3.0
"""Seconds a shutdown waits for the ``stopped`` row to be written."""

__all__ = [
    "DEFAULT_HEARTBEAT",
    "ENV_INSTANCE",
    "LIVE",
    "LIVE_INTERVALS",
    "STALE",
    "STOPPED",
    "InstanceRecord",
    "Loaded",
    "Presence",
    "Source",
    "codec_source",
    "instance_name",
    "presence_for",
    "read_instances",
    "ring_source",
    "stop_all",
]


class Presence:
    """The heartbeat of one instance into one store (see the module docstring).

    Args:
        store: the audit store (`put_instance`).
        name: the instance name (`instance_name`).
        kind: ``library`` or ``sidecar``.
        every: seconds between heartbeats.
        clock: POSIX time source (tests inject one).
    """

    def __init__(
        self,
        store: AuditStore,
        *,
        name: str,
        kind: str,
        every: float = DEFAULT_HEARTBEAT,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.name = name
        self.kind = kind
        self.every = check_heartbeat(every)
        self._clock = clock
        self._version = __version__
        self._started = format_ts(clock())
        self._sources: list[Source] = []
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.stopped = False
        self.beats = 0
        self.error: str | None = None
        self.last: InstanceRecord | None = None
        self._usage: UsageReporter | None = None

    def __repr__(self) -> str:
        return f"Presence({self.name!r}, kind={self.kind!r}, every={self.every:g}, store={self.store.url!r})"

    def usage(self) -> UsageReporter:
        """This process's seal counts reporter into the same store (`mrtr_keys.fleet.usage.reporter_for`: one for
        every presence of the process in that store), started on first use; `stop` lets it go (the last user's
        stop writes its final counts) before the ``stopped`` row."""
        with self._lock:
            if self._usage is None:
                self._usage = reporter_for(self.store, instance=self.name)
            return self._usage

    def add(self, source: Source) -> None:
        """Report on `source` too, and beat now (synchronously), so the instance is visible before it serves."""
        with self._lock:
            self._sources.append(source)
        self.beat()

    def record(self) -> InstanceRecord | None:
        """The row the next heartbeat writes; None when every source is gone."""
        views: list[Loaded] = []
        with self._lock:
            alive: list[Source] = []
            for source in self._sources:
                view = source()
                if view is not None:
                    views.append(view)
                    alive.append(source)
            self._sources = alive
        if not views:
            return None
        low = min(views, key=lambda v: v.generation)  # the gates care about the most lagging codec
        notes = sorted((v.note for v in views if v.note), key=lambda n: not n.startswith(STUCK_NOTE))
        return InstanceRecord(
            name=self.name,
            host=socket.gethostname(),
            pid=os.getpid(),
            kind=self.kind,
            codec=",".join(sorted({v.codec for v in views})),
            ring_id=low.ring_id,
            generation=low.generation,
            primary_kid=low.primary_kid,
            version=self._version,
            started=self._started,
            beat=format_ts(self._clock()),
            every_s=self.every,
            state=RUNNING,
            note=textwrap.shorten(notes[0], NOTE_CHARS, placeholder=" …") if notes else None,
        )

    def beat(self) -> bool:
        """Write one heartbeat now. False if it could not be written (logged once per message) or the
        instance has stopped; when every source is gone, writes ``stopped`` instead."""
        with self._lock:
            if self.stopped:
                return False
            rec = self.record()
            if rec is None:
                if self._sources_were_added:
                    self._write_stopped()
                return False
            return self._write(rec)

    def beat_soon(self) -> None:
        """Have the heartbeat thread write now if what is loaded changed (it checks at once), without
        waiting for the store here: the watcher's ``on_switch``, so a silent store never holds up a
        reload (issue 22). Without a running thread, writes now (`beat`)."""
        if self._thread is None or not self._thread.is_alive():
            self.beat()
            return
        self._wake.set()

    @property
    def _sources_were_added(self) -> bool:
        return self.last is not None

    def _write(self, rec: InstanceRecord) -> bool:
        try:
            self.store.put_instance(rec.row())
        except Exception as exc:  # AuditError, or a store closed under us: the next beat tries again
            if not isinstance(exc, AuditError | OSError):
                exc = AuditError(f"{type(exc).__name__}: {exc}")
            if str(exc) != self.error:
                log.warning("presence heartbeat not written (instance %s): %s", self.name, exc)
            self.error = str(exc)
            return False
        if self.error is not None:
            log.warning("presence heartbeat written again (instance %s)", self.name)
        self.error = None
        self.last = rec
        self.beats += 1
        return True

    def _write_stopped(self) -> None:
        self.stopped = True
        self._wake.set()
        last = self.last
        if last is None:
            return
        self._write(replace(last, beat=format_ts(self._clock()), state=STOPPED))

    def stop(self) -> None:
        """Write the final seal counts (`usage`), then the ``stopped`` row (once), and end the heartbeat thread."""
        with self._lock:
            usage, self._usage = self._usage, None
        if usage is not None:
            release(usage)
        with self._lock:
            if self.stopped:
                return
            rec = self.record()
            if rec is not None:
                self.last = rec
            self._write_stopped()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STOP_TIMEOUT)

    def start(self) -> Presence:
        """Start the heartbeat thread (daemon). Returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"mrtr-keys-presence-{self.name}", daemon=True)
            self._thread.start()
            _install_shutdown_hooks()
        return self

    def _run(self) -> None:
        # Wake often but write only every `every` seconds, or at once when what is loaded changed
        # (a reload by the watcher, or a codec.reload() called by hand): the gates see it promptly.
        next_beat = time.monotonic() + self.every
        while not self.stopped:
            self._wake.wait(min(self.every, CHANGE_POLL))
            self._wake.clear()
            if self.stopped:
                return
            try:
                due = time.monotonic() >= next_beat or self._changed()
                if due:
                    self.beat()
                    next_beat = time.monotonic() + self.every
            except Exception:  # the heartbeat must survive anything; the next one tries again
                log.exception("presence heartbeat failed")

    def _changed(self) -> bool:
        last = self.last
        if last is None:
            return True
        now = self.record()
        return now is None or (now.generation, now.primary_kid, now.note, now.ring_id) != (
            last.generation,
            last.primary_kid,
            last.note,
            last.ring_id,
        )


_presences: dict[tuple[str, str], Presence] = {}
_registry_lock = threading.Lock()


def presence_for(
    store: AuditStore, *, name: str | None = None, kind: str = "library", every: float | None = None
) -> Presence:
    """This process's (started) `Presence` for `store` and instance `name` (made on first use).

    Raises:
        ConfigError: a bad name or interval.
    """
    resolved = instance_name(name)
    interval = check_heartbeat(DEFAULT_HEARTBEAT if every is None else every)
    key = (store.url, resolved)
    with _registry_lock:
        presence = _presences.get(key)
        if presence is None or presence.stopped:
            presence = _presences[key] = Presence(store, name=resolved, kind=kind, every=interval)
            presence.start()
        return presence


def why_behind(stuck: str | None, refused: str | None, fenced: str | None) -> str | None:
    """The heartbeat's note from a stuck watcher's note, a refused ring and the fence's note: the first of the
    stuck and refused notes (a stuck one leads: the gates read it, `InstanceRecord.watcher_stuck`), then the
    fence's after ``; `` (an instance cut from its keystore is both stuck and serving fenced out, and says
    both); None when there is none."""
    lead = stuck or refused
    return "; ".join(n for n in (lead, fenced) if n) or None


def codec_source(codec: Any, watcher: RingWatcher | None) -> Source:
    """A `Source` over a key-ring codec (held weakly) and its watcher (None: reload is off)."""
    ref = weakref.ref(codec)

    def view() -> Loaded | None:
        target = ref()
        if target is None:
            return None
        ring = target.ring
        refused = getattr(target, "reload_refused", None)
        stuck = watcher.stuck_note() if watcher is not None else None
        fence = getattr(target, "fence", None)
        fenced = fence.note() if fence is not None else None
        kek = getattr(target, "kek", None)
        closed = kek.note() if kek is not None else None
        if closed and kek is not None and kek.closed:  # failing closed says more than anything else
            note: str | None = closed
        else:
            note = why_behind(stuck, f"refused a ring: {refused}" if refused else None, fenced)
        if note is None:
            note = "reload off" if watcher is None else (f"keystore: {watcher.error}" if watcher.error else None)
        if note is None:
            note = closed  # the wrapping key could not be checked (an outage), or None
        return Loaded(ring.codec.type, ring.ring_id, ring.generation, ring.primary.kid, note)

    return view


def ring_source(codec: Any) -> Callable[[], Any]:
    """The ring a key-ring codec (held weakly) has loaded now, or None once it is gone: what
    `mrtr_keys.fleet.usage.UsageReporter.watch` reads."""
    ref = weakref.ref(codec)

    def ring() -> Any:
        target = ref()
        return None if target is None else target.ring

    return ring


def stop_all() -> None:
    """Write ``stopped`` for every presence of this process (shutdown hooks call this)."""
    for presence in list(_presences.values()):
        try:
            presence.stop()
        except Exception:  # at shutdown: carry on with the others
            log.exception("writing the stopped record")


_hooks_installed = False
_previous_sigterm: Any = None


def _install_shutdown_hooks() -> None:
    """``stopped`` at interpreter exit, and on SIGTERM (chained to the handler found, then the default)."""
    global _hooks_installed, _previous_sigterm
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(stop_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still covers a clean exit
    with contextlib.suppress(ValueError, OSError):
        _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Write from another thread (bounded): the main thread, interrupted here, may hold a store lock.
    writer = threading.Thread(target=stop_all, name="mrtr-keys-presence-stop", daemon=True)
    writer.start()
    writer.join(STOP_TIMEOUT)
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.raise_signal(signal.SIGTERM)
