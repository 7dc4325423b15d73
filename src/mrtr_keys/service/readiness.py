"""The sidecar's live state between requests: codecs per audience, readiness, reload, ``ring-loaded``.

`RingLifecycle` is the base of `mrtr_keys.service.handlers.SidecarCore`: it owns the `RingState` and
the `ClientAuth`, calls codecs (on the event loop for in-memory codecs, in a worker thread for codecs
that may call out per token), answers ``/readyz`` with a seal/unseal self-test (and a ping of the replay
store when single-use is on), and gives the ring watcher (`mrtr_keys.keystores.watch`, every
``reload_interval`` seconds and on SIGHUP) what it calls to swap in a new generation and client registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio.to_thread
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.audit.events import format_ts
from mrtr_keys.backends import Codec
from mrtr_keys.replay.service_guard import SidecarReplay
from mrtr_keys.ring.model import KeyRing
from mrtr_keys.service.auth import ClientAuth
from mrtr_keys.service.config import ServiceConfig
from mrtr_keys.service.metrics import SidecarMetrics
from mrtr_keys.service.outcomes import AuditSink, Rejected, Result, dump
from mrtr_keys.service.reload import PROBE_AUDIENCE, RingState

if TYPE_CHECKING:
    from mrtr_keys.audit.retention.loop import Retention
    from mrtr_keys.audit.verifying.anchor import Anchorer
    from mrtr_keys.codecs.fence import Fence
    from mrtr_keys.fleet.presence import Presence
    from mrtr_keys.fleet.usage import UsageReporter
    from mrtr_keys.keystores.watch import RingWatcher

log = logging.getLogger("mrtr_keys.service")

STALE_NOTE = "the stored key ring cannot be loaded; serving the last good generation (see the server log)"


def probe_audience(ring: KeyRing) -> str:
    """The audience the readiness self-test seals for: the first in scope, else `PROBE_AUDIENCE`."""
    return ring.audiences[0] if ring.audiences else PROBE_AUDIENCE


class RingLifecycle:
    """The ring, clients, metrics and audit sink of one sidecar process, and their upkeep.

    Args:
        ring: the live key ring (`RingState`).
        auth: the live client registry (`ClientAuth`).
        config: limits and the reload interval.
        audit: optional `AuditSink` (``ring_loaded(generation, kid)`` is called if it has one).
    """

    def __init__(
        self, ring: RingState, auth: ClientAuth, config: ServiceConfig, *, audit: AuditSink | None = None
    ) -> None:
        self.ring = ring
        self.auth = auth
        self.config = config
        self.audit = audit
        self.strict_audit = config.strict_audit
        self._ring_loaded()
        self.metrics = SidecarMetrics()
        self.metrics.generation.set(ring.ring.generation)
        if audit is not None:
            self.metrics.watch_audit(getattr(audit, "sink", audit))
        self.metrics.watch_ring(ring)
        self.metrics.watch_stores(self.stores_down)
        self.usage: UsageReporter | None = None
        """The seal counts reporter into the presence store (`mrtr_keys.fleet.usage`; the keeper starts it), or
        None (no presence store: counts stay in this process)."""
        self.metrics.watch_usage(ring, lambda: self.usage)
        self.replay: SidecarReplay | None = None
        if config.replay_store:  # single-use unseals (docs/single-use.md)
            self.replay = SidecarReplay(
                config.replay_store,
                clients=config.single_use_clients,
                audiences=config.single_use_audiences,
                on_store_error=config.on_replay_store_error,  # type: ignore[arg-type]
                ring_ttl=lambda: ring.ring.ttl_seconds,
                registry=self.metrics.registry,
            )
        self.watcher: RingWatcher | None = None
        """The ring watcher (`mrtr_keys.service.reload.keep_current`; the app's lifespan starts it)."""
        self.presence: Presence | None = None
        self.retention: Retention | None = None
        """The audit retention loop (``--audit-retention``; the keeper starts it), or None (off)."""
        self.anchor: Anchorer | None = None
        """The audit anchor loop (``--audit-anchor``; the keeper starts it), or None (off)."""
        self._audit_down_logged: object = None
        self.fence: Fence | None = None
        """The self-fencing lease and unknown-kid look over the watcher (`keep_current` sets it)."""

    # ---------------------------------------------------------------- codecs

    async def _codec(self, audience: str) -> Codec:
        codec = self.ring.snapshot.codecs.get(audience)
        if codec is None:
            codec = await anyio.to_thread.run_sync(self.ring.open, audience)
        return codec

    async def _run(self, fn: Callable[[Any], Any], arg: Any) -> tuple[Any, str | None]:
        """Call a codec method: on the event loop for in-memory codecs, else in a worker thread."""
        if self.ring.inline:
            return self._call(fn, arg)
        return await anyio.to_thread.run_sync(self._call, fn, arg)

    def _call(self, fn: Callable[[Any], Any], arg: Any) -> tuple[Any, str | None]:
        """`fn(arg)` and the kid the codec reported; `Rejected` for the SDK's `InvalidRequestState`."""
        tap = self.ring.tap
        tap.clear()
        try:
            value = fn(arg)
        except InvalidRequestState as exc:
            raise Rejected(str(exc), tap.take()) from None
        return value, tap.take()

    # ---------------------------------------------------------------- fencing

    async def _fenced(self) -> None:
        """The self-fencing lease (`mrtr_keys.codecs.fence`): once it ran out, check the keystore (in a
        worker thread, bounded by its deadline) before serving; counted when served fenced out."""
        fence = self.fence
        if fence is not None and fence.expired():
            await anyio.to_thread.run_sync(fence.ensure)
            if fence.error is not None:
                self.metrics.fenced.inc()

    async def _look_again(self, generation: int) -> bool:
        """After an unknown kid: one rate-limited keystore check (`Fence.look_again`); True to retry."""
        fence = self.fence
        ring = self.ring
        if fence is None or not fence.may_look():  # a forged kid flood costs no thread hop
            return ring.ring.generation != generation
        return bool(await anyio.to_thread.run_sync(fence.look_again, generation, lambda: ring.ring.generation))

    # ---------------------------------------------------------------- state

    def describe(self) -> dict[str, Any]:
        """``GET /v1/keys``: the ring's public description and the reload error note (never material)."""
        doc = self.ring.ring.describe()
        doc["reload_error"] = self.stale_note()
        return doc

    def stale_note(self) -> str | None:
        """Why the loaded ring may not be the stored one, or None: the ring watcher is stuck (no check
        completed in 3 intervals), the stored ring was refused (an older generation, the same one
        with other content, another ring) or cannot be loaded; or its wrapping key could not be checked
        (an outage of KMS or Vault, `mrtr_keys.codecs.kek`: as a keystore outage)."""
        watcher = self.watcher
        stuck = watcher.stuck_note() if watcher is not None else None
        kek = self.ring.kek()
        unchecked = self.ring.kek_note() if kek is not None and not kek.closed else None
        return stuck or self.ring.refused or (STALE_NOTE if self.ring.error else None) or unchecked

    def watcher_status(self) -> dict[str, Any] | None:
        """``/readyz``'s ``watcher``: the last completed keystore check and, when stuck, since when."""
        watcher = self.watcher
        if watcher is None or watcher.interval == 0:
            return None
        from mrtr_keys.keystores.watch import utc_text

        last, since = watcher.last_check, watcher.stuck_since()
        return {
            "interval_seconds": watcher.interval,
            "last_check": None if last is None else utc_text(last),
            "stuck_since": None if since is None else utc_text(since),
        }

    def key_usage(self) -> dict[str, Any]:
        """``/readyz``'s ``key_usage`` (authenticated callers): each usable key's fleet-wide seals (the presence
        store's total, never below the truth; this process's own without a store: ``scope``), its budget and the
        fraction used, with the warning sentence from 50 % (`mrtr_keys.fleet.usage.budget_note`). Sealing never
        stops on a budget, so this never makes the sidecar unready. No I/O: the reporter's last reading."""
        from mrtr_keys.codecs.usage import usage_for
        from mrtr_keys.fleet.usage_view import budget_note
        from mrtr_keys.ring.budgets import WARN_AT, budget_of

        ring = self.ring.ring
        reporter = self.usage
        fleet = reporter.totals.get(ring.ring_id, {}) if reporter is not None else None
        keys = []
        for key in ring.usable_keys():
            seals = fleet[key.kid].seals if fleet and key.kid in fleet else usage_for(ring.ring_id).kid(key.kid).seals
            budget = budget_of(ring, key)
            entry: dict[str, Any] = {
                "kid": key.kid,
                "state": key.state.value,
                "format": key.format.value,
                "seals": seals,
                "budget": budget,
                "used": round(seals / budget, 6),
            }
            if seals / budget >= WARN_AT:
                entry["note"] = budget_note(key.kid, seals, budget)
            keys.append(entry)
        out: dict[str, Any] = {"scope": "fleet" if reporter is not None else "process", "keys": keys}
        if reporter is not None:
            out["last_success"] = None if reporter.last_success is None else format_ts(reporter.last_success)
            out["error"] = reporter.error
        return out

    def stores_down(self) -> dict[str, float | None]:
        """The stores that count as down now, each with the POSIX time since when (None if unknown):
        ``audit`` (writes failing, or none acknowledged for 1 s with events waiting) and ``replay``
        (its last call failed). Cheap: no I/O (`/metrics` and `/readyz` read it)."""
        down: dict[str, float | None] = {}
        audit_ready = getattr(self.audit, "ready", None)
        if audit_ready is not None and not audit_ready():
            down["audit"] = getattr(self.audit, "down_since", None)
        replay = getattr(self, "replay", None)  # the metrics registry reads this once while __init__ runs
        if replay is not None and replay.down_since is not None:
            down["replay"] = replay.down_since
        return down

    async def readyz(self, strict: bool = False, *, detail: bool = False) -> Result:
        """200 when the ring is loaded and a seal/unseal self-test passes (backend reachable), else 503.

        With `strict`, a stored ring that cannot be loaded or was refused (last good one serving) and a
        stuck ring watcher (`stale_note`) also give 503. ``down`` names each component that is down
        (``codec``, ``audit``, ``replay``) with the time since when; the error text of a store (which may
        name hosts and users) goes to the log and, with `detail` (an authenticated caller), into the answer
        (``audit``, ``replay``). ``fenced_out`` is the fence's note while the sidecar serves fenced out (its
        lease ran out and the keystore check failed: `mrtr_keys.codecs.fence`), the one its heartbeat carries;
        serving so is by design, so it changes no status.
        """
        ring = self.ring.ring
        stale = self.stale_note()
        down: dict[str, str | None] = {}
        try:
            codec = await self._codec(probe_audience(ring))
            token, _ = await self._run(codec.seal, b"readyz")
            payload, _ = await self._run(codec.unseal, token)
            ok = payload == b"readyz"
        except Exception as exc:
            log.warning("readiness self-test failed: %s", getattr(exc, "reason", None) or type(exc).__name__)
            ok = False
        doc: dict[str, Any] = {"ready": ok, "generation": ring.generation, "reload_error": stale}
        watcher = self.watcher_status()
        if watcher is not None:
            doc["watcher"] = watcher
        fenced = self.fence.note() if self.fence is not None else None
        if fenced is not None:
            doc["fenced_out"] = fenced
        kek = self.ring.kek()
        if kek is not None:
            times = ("last_ok", "last_check", "closed_since")
            doc["wrapping_key"] = {k: (format_ts(v) if k in times and v else v) for k, v in kek.status().items()}
        if not ok:
            doc["reason"] = "the key ring's codec failed a seal/unseal self-test (backend unreachable?)"
            down["codec"] = None
        if kek is not None and kek.closed:  # the self-test failed for this reason: name it
            doc["reason"] = self.ring.kek_note()
            ok = False
            down["codec"] = None if kek.closed_since is None else format_ts(kek.closed_since)
        audit_status = getattr(self.audit, "status", None)
        if detail and audit_status is not None:
            doc["audit"] = audit_status()
        if detail:
            doc["key_usage"] = self.key_usage()
        if self.retention is not None:
            doc["audit_retention"] = self.retention.status()
        if detail and self.anchor is not None:
            doc["audit_anchor"] = self.anchor.status()
        replay = self.replay
        if replay is not None and not await anyio.to_thread.run_sync(replay.ready):
            if ok:
                doc["reason"] = "the replay store cannot be reached (see the server log)"
            ok = False
        stores = self.stores_down()
        if "replay" in stores:
            if ok:
                doc["reason"] = "the replay store cannot be reached (see the server log)"
            ok = False
        if "audit" in stores:
            status = getattr(self.audit, "status", None)
            error = status().get("error") if status is not None else None
            if error != self._audit_down_logged:
                log.warning("readiness: the audit store is down: %s", error)
                self._audit_down_logged = error
            doc["reason"] = "the audit store cannot be written (see the server log)"
            ok = False
        for name, since in stores.items():
            down[name] = None if since is None else format_ts(since)
        if detail and replay is not None:
            doc["replay"] = {"url": replay.guard.store.url, "down_since": down.get("replay")}
        if down:
            doc["down"] = down
        ready = ok and not (strict and stale)
        doc["ready"] = ready
        return (200 if ready else 503), dump(doc), None

    # ---------------------------------------------------------------- reload

    def reload_now(self) -> bool:
        """Poll the client registry and the keystore once (blocking I/O: call off the event loop)."""
        self.poll_registry()
        return self.reload_ring()

    def poll_registry(self) -> None:
        """Reload the client registry if its file changed, and open codecs for new audiences."""
        if self.auth.refresh():
            self.ring.prepare(self.auth.registry.audiences())

    def reload_ring(self) -> bool:
        """Re-read the keystore and switch if it holds a newer ring (the ring watcher's reload). True if switched."""
        had_error = self.ring.error
        switched = self.ring.reload(self.auth.registry.audiences())
        if switched:
            self._ring_loaded()
            self.metrics.reloads.labels("switched").inc()
            self.metrics.generation.set(self.ring.ring.generation)
            self.metrics.loaded_at.set_to_current_time()
        elif self.ring.error and self.ring.error != had_error:
            self.metrics.reloads.labels("failed").inc()
        self.metrics.stale.set(1 if self.ring.error or self.ring.refused else 0)
        return switched

    def _ring_loaded(self) -> None:
        """Record ``ring-loaded`` in the audit log (synchronously) if the sink supports it (docs/audit.md)."""
        hook = getattr(self.audit, "ring_loaded", None)
        if hook is not None:
            hook(self.ring.ring.generation, self.ring.ring.primary.kid)

    def wake(self) -> None:
        """Check the keystore now, with a full read (SIGHUP)."""
        if self.watcher is not None:
            self.watcher.wake()
