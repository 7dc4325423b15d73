"""The sidecar's live key ring: codecs per audience, swapped atomically on a new generation.

The sidecar holds no crypto of its own. For each audience it asks
`mrtr_keys.factory.open_codec` for the codec the stored ring records (local,
KMS envelope, Vault, ...), over a `PinnedKeystore` that hands the codec exactly
the ring this process validated, so every codec of one snapshot sees one
generation. `RingState.reload()` reads the keystore; if the generation changed
it builds the codecs of every audience in use for the new ring and then
replaces the whole `Snapshot` in one assignment, so a request sees either the
old snapshot or the new one, never a mix. A ring that fails to load or to open
is logged, reported (`error`, ``/readyz``, metrics) and never replaces the
loaded one: sealing continues on the last good ring. A ring with a lower
generation (a restored backup, in which a retired kid would be usable again) or
another ``ring_id`` is refused the same way (`refused`, a WARNING), and so is a ring
the process's codec pin refuses (another codec type or KMS key, `mrtr_keys.codecs.pin`;
at start that is a `ConfigError`). The
sidecar's `mrtr_keys.keystores.watch.RingWatcher` decides when to call
`RingState.reload` (the same watcher every library codec uses).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrtr_keys.backends import Codec
from mrtr_keys.codecs.generations import SWITCH, next_ring
from mrtr_keys.codecs.pin import RingPin
from mrtr_keys.errors import AudienceError, MrtrKeysError
from mrtr_keys.keystores import Keystore
from mrtr_keys.ring.model import KeyRing

log = logging.getLogger("mrtr_keys.service")

PROBE_AUDIENCE = "mrtr-keys.readyz"
"""Audience of the readiness self-test when the ring's scope is empty (never leaves the process)."""


class PinnedKeystore:
    """A read-only view of a keystore whose `load()` returns one already validated ring."""

    def __init__(self, inner: Keystore, ring: KeyRing) -> None:
        self._inner = inner
        self._ring = ring

    def __repr__(self) -> str:
        return f"PinnedKeystore({self._inner!r}, generation={self._ring.generation})"

    @property
    def url(self) -> str:
        return self._inner.url

    @property
    def directory(self) -> Path:
        return self._inner.directory

    def exists(self) -> bool:
        return True

    def load(self) -> KeyRing:
        return self._ring

    def revision(self) -> str:
        return f"pinned:{self._ring.generation}"

    def create(self, ring: KeyRing) -> None:
        raise MrtrKeysError("the sidecar never writes the key ring")

    def save(self, ring: KeyRing, *, expected_generation: int) -> None:
        raise MrtrKeysError("the sidecar never writes the key ring")

    def locked(self) -> AbstractContextManager[None]:
        return self._inner.locked()


class KidTap:
    """A `CodecObserver` that remembers the kid of the calling thread's last codec operation."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._count_lock = threading.Lock()
        self.rejections: dict[str, int] = {}
        """Codec rejections by reason code (``unknown kid``, ``retired kid``, ``seal``, ...), for /metrics."""

    def sealed(self, kid: str, token: str) -> None:
        self._local.kid = kid

    def unsealed(self, kid: str, token: str) -> None:
        self._local.kid = kid

    def rejected(self, kid: str | None, token: str, reason: str) -> None:
        self._local.kid = kid
        key = reason[:32]  # the codecs' fixed reason codes; capped so a label value stays bounded
        with self._count_lock:
            self.rejections[key] = self.rejections.get(key, 0) + 1

    def ring_loaded(self, generation: int, kid: str | None = None) -> None:
        """Nothing: the sidecar reports its generations itself (`mrtr_keys.service.readiness`)."""

    def clear(self) -> None:
        self._local.kid = None

    def take(self) -> str | None:
        kid: str | None = getattr(self._local, "kid", None)
        self._local.kid = None
        return kid


@dataclass
class Snapshot:
    """One generation in use: the ring and its codecs by audience (filled lazily, never shared across rings)."""

    ring: KeyRing
    codecs: dict[str, Codec] = field(default_factory=dict)
    unusable: dict[str, str] = field(default_factory=dict)
    """Audience -> why no codec opens for it (outside the ring's scope)."""


class RingState:
    """The ring this process serves, and how to reach a codec for an audience.

    Args:
        keystore: where the ring lives (read only).
        backend_options: passed to `open_codec` (e.g. KMS/Vault client settings).
        pin: the codec pin (`mrtr_keys.codecs.pin.RingPin`): rings of another codec type or KMS key are
            refused, at start and on reload.

    Raises (constructor):
        KeyRingNotFound, KeystoreError, KeyRingError, BackendUnavailable: no usable ring at start.
        ConfigError: the pin refuses the stored ring.
    """

    def __init__(
        self, keystore: Keystore, *, backend_options: dict[str, Any] | None = None, pin: RingPin | None = None
    ) -> None:
        self.keystore = keystore
        self.pin = pin
        self.tap = KidTap()
        self._options = dict(backend_options or {})
        self._lock = threading.Lock()
        self.error: str | None = None
        self.refused: str | None = None
        """Why the stored ring was refused (lower generation, another ring_id); None when it was not."""
        from mrtr_keys.keystores.watch import lease_clock

        self.loaded_at = lease_clock()
        """`lease_clock` time just before the first ring was read (the self-fencing lease starts there)."""
        ring = keystore.load()
        if pin:
            pin.check(ring)
        self.snapshot = Snapshot(ring)
        self.inline = True
        self.probe_audience = ring.audiences[0] if ring.audiences else PROBE_AUDIENCE
        self._open(self.snapshot, self.probe_audience)

    @property
    def ring(self) -> KeyRing:
        return self.snapshot.ring

    def codec(self, audience: str) -> Codec | None:
        """The codec for `audience` in the current snapshot if already built (no I/O), else None."""
        return self.snapshot.codecs.get(audience)

    def open(self, audience: str) -> Codec:
        """Build (or return) the codec for `audience` in the current snapshot; may do I/O (call off-loop).

        Raises:
            AudienceError: the ring's scope excludes `audience`.
            MrtrKeysError: the backend cannot give its keys.
        """
        return self._open(self.snapshot, audience)

    def _open(self, snap: Snapshot, audience: str) -> Codec:
        codec = snap.codecs.get(audience)
        if codec is not None:
            return codec
        from mrtr_keys.factory import build_codec

        try:
            pinned = PinnedKeystore(self.keystore, snap.ring)
            codec = build_codec(pinned, audience=audience, observer=self.tap, **self._options)
        except AudienceError as exc:
            snap.unusable[audience] = str(exc)
            raise
        if codec.remote_per_token:
            self.inline = False  # a codec that may call out per token: run it off the event loop
        snap.codecs[audience] = codec
        return codec

    def reload(self, audiences: Iterable[str] = ()) -> bool:
        """Re-read the keystore; switch atomically if the ring changed. True if it switched.

        Opens the codecs of the audiences already in use plus `audiences` for the new ring first;
        if the ring cannot be loaded or a codec cannot open (other than an audience the new scope
        drops), the loaded snapshot stays and `error` says why.
        """
        with self._lock:
            old = self.snapshot
            try:
                ring = self.keystore.load()
                step = next_ring(old.ring, ring, refused_before=self.refused, log=log, pin=self.pin)
                if step.outcome != SWITCH:
                    self.refused, self.error = step.refused, None
                    return False
                snap = Snapshot(ring)
                for aud in _unique([*old.codecs, *audiences, self.probe_audience]):
                    try:
                        self._open(snap, aud)
                    except AudienceError:
                        pass
            except MrtrKeysError as exc:
                if self.error != str(exc):
                    log.warning("key ring not reloaded, still serving generation %d: %s", old.ring.generation, exc)
                self.error = str(exc)
                return False
            self.snapshot = snap
            self.error = self.refused = None
        log.info("key ring generation %d loaded (was %d)", ring.generation, old.ring.generation)
        return True

    def kek(self) -> Any:
        """The wrapping-key check (`mrtr_keys.codecs.kek.KekCheck`) of a codec of the current snapshot: the one
        failing closed if any, else one that could not reach the key, else any; None for a ring without one."""
        checks = [k for c in list(self.snapshot.codecs.values()) if (k := getattr(c, "kek", None)) is not None]
        return (
            next((k for k in checks if k.closed), None)
            or next((k for k in checks if k.error), None)
            or (checks[0] if checks else None)
        )

    def kek_note(self) -> str | None:
        """Why the wrapping key makes this ring unusable (failing closed) or unchecked (unreachable), else None."""
        kek = self.kek()
        return None if kek is None else kek.note()

    def prepare(self, audiences: Iterable[str]) -> None:
        """Open codecs for `audiences` now (errors are left for the request that needs them)."""
        snap = self.snapshot
        for aud in audiences:
            try:
                self._open(snap, aud)
            except MrtrKeysError:
                pass


class Keeper:
    """Keeps the sidecar current: its ring watcher and its presence heartbeat (see `keep_current`)."""

    def __init__(self, core: Any, config: Any) -> None:
        from mrtr_keys.keystores.watch import ReloadFailed, RingWatcher

        self._core, self._config = core, config
        state: RingState = core.ring

        def reload() -> bool:
            switched = bool(core.reload_ring())
            if state.error is not None:
                raise ReloadFailed(state.error)
            return switched

        def on_error(message: str | None) -> None:  # the keystore's outage shows in /readyz and metrics
            if message is not None and message != state.error:
                core.metrics.reloads.labels("failed").inc()
            state.error = message
            core.metrics.stale.set(1 if message or state.refused else 0)

        self.watcher = RingWatcher(
            state.keystore, reload, interval=config.reload_interval, every_check=core.poll_registry, on_error=on_error
        )
        core.watcher = self.watcher
        core.metrics.watch_watcher(self.watcher)
        core.fence = sidecar_fence(self.watcher, config, loaded_at=state.loaded_at)

    def start(self) -> None:
        """Write the first heartbeat (when the audit sink has a store) and start the watcher: the app's
        lifespan calls this before serving. Not at construction, so a process that only checks the
        configuration (``serve --workers N`` before forking) never shows up as an instance."""
        import os

        from mrtr_keys.fleet.presence import Loaded, instance_name, presence_for, why_behind

        core, config, watcher = self._core, self._config, self.watcher
        state: RingState = core.ring
        store = getattr(getattr(core.audit, "sink", None), "store", None)
        if config.reload_interval == 0:
            log.warning(
                "automatic key ring reload is off (reload_interval 0): serving generation %d until restarted or "
                "SIGHUP; this instance holds back the rotation gates",
                state.ring.generation,
            )
        if store is not None:
            name = instance_name(config.instance)
            if config.workers > 1:
                name = f"{name}/{os.getpid()}"
            presence = presence_for(store, name=name, kind="sidecar", every=config.heartbeat_interval)

            def view() -> Loaded:
                ring = state.ring
                fence = core.fence
                fenced = fence.note() if fence is not None else None  # it names the keystore error too
                note = why_behind(watcher.stuck_note(), state.refused, fenced) or state.kek_note()
                if note is None and state.error:
                    note = f"keystore: {state.error}"
                if note is None and watcher.error:
                    note = f"keystore: {watcher.error}"
                if note is None and watcher.interval == 0:
                    note = "reload off"
                return Loaded(ring.codec.type, ring.ring_id, ring.generation, ring.primary.kid, note)

            presence.add(view)
            usage = core.usage = presence.usage()
            usage.watch(lambda: state.ring)  # one round now: the primary is reserved before the first seal
            beat = presence.beat_soon

            def on_switch() -> None:  # threads of their own write: a silent store never holds a reload
                beat()
                usage.wake()

            watcher.on_switch = on_switch
            core.presence = presence
            if config.audit_retention:
                core.retention = sidecar_retention(store.url, state, config, core.audit)
                core.metrics.watch_retention(core.retention)
                core.retention.start()
            sink = getattr(core.audit, "sink", None)
            if config.audit_anchor and sink is not None:
                from mrtr_keys.audit.verifying.anchor import anchor_sink

                core.anchor = anchor_sink(sink, config.audit_anchor, config.audit_anchor_every)
                core.metrics.watch_anchor(core.anchor)
        watcher.start()

    def stop(self) -> None:
        """Stop the watcher and write ``stopped`` (the app's lifespan calls this at shutdown)."""
        self.watcher.stop()
        if self._core.retention is not None:
            self._core.retention.stop()
        if self._core.anchor is not None:  # the last heads, after the lifespan's flush (`final_anchor`)
            self._core.anchor.stop(final=False)
        if self._core.presence is not None:
            self._core.presence.stop()


def sidecar_retention(url: str, state: RingState, config: Any, audit: Any = None) -> Any:
    """The sidecar's `mrtr_keys.audit.retention.loop.Retention` over the audit store `url`: cuts go to
    ``MRTR_KEYS_AUDIT_CHECKPOINTS``, else ``audit-checkpoints.jsonl`` in the ring's state directory
    (where ``audit prune`` and ``audit verify`` look by default); keyed links are checked with the
    audit key of the sidecar's sink `audit` (`mrtr_keys.audit.capture.service_sink.SidecarAudit`) and the
    retired ones (``MRTR_KEYS_AUDIT_OLD_KEY_FILES``)."""
    import os

    from mrtr_keys.audit.retention.loop import Retention
    from mrtr_keys.audit.writing.chain_key import ChainKey, old_audit_keys

    sink = getattr(audit, "sink", None)
    keys = [sink.chain_key, *(ChainKey(k) for k in old_audit_keys())] if sink is not None else []
    env = os.environ.get("MRTR_KEYS_AUDIT_CHECKPOINTS")
    path = Path(env) if env else state.keystore.directory / "audit-checkpoints.jsonl"
    return Retention(
        url,
        config.audit_retention,
        path,
        lambda: state.ring.ttl_seconds,
        interval=config.audit_retention_interval,
        chain_keys=keys,
    )


def sidecar_fence(watcher: Any, config: Any, *, loaded_at: float | None = None) -> Any:
    """The sidecar's `Fence` (`mrtr_keys.codecs.fence`): ``config.lease``, else 3 heartbeat intervals (the
    gates' staleness window), or off when reload is off."""
    from mrtr_keys.codecs.fence import Fence, default_lease

    lease = config.lease
    if lease is None:
        lease = default_lease(config.heartbeat_interval) if config.reload_interval > 0 else 0.0
    return Fence(watcher, lease=lease, loaded_at=loaded_at, max_fenced_out=config.max_fenced_out)


def keep_current(core: Any, config: Any) -> Keeper:
    """The `Keeper` of the sidecar `core` (`SidecarCore`): its ring watcher (the one every library codec
    uses; `core.watcher`, so SIGHUP can wake it) and, once started, its presence heartbeat. `config` is
    the `ServiceConfig` (reload and heartbeat intervals, instance name; with several workers each adds
    ``/PID`` to the name)."""
    return Keeper(core, config)


def _unique(items: Iterable[str]) -> Iterator[str]:
    seen: set[str] = set()
    for item in items:
        if item not in seen:
            seen.add(item)
            yield item
