"""The sidecar's audit sink: plugs the audit log into `mrtr_keys.service.app.create_app(audit=...)`.

The sidecar calls the sink once per operation with ``op``, ``audience``, ``client``, ``kid``,
``outcome``, ``reason``, ``token`` (fingerprinted in the writer thread, never stored) and
``duration_ms``; `SidecarAudit` queues that as one event. It also records ``ring-loaded`` at start
and on every reload that switches generation (at once while the store answers, else in the background).

Strict mode (``strict_audit = true``): while the store cannot be written, or while the writer is
behind (the queue past its high-water mark), a call raises `AuditError`, so the sidecar answers
503 instead of sealing or unsealing unrecorded. Otherwise a call past the high-water mark waits
for the writer (`mrtr_keys.audit.capture.queue`). `ready()` is False while the store cannot be written,
in either mode, so ``/readyz`` fails.
"""

from __future__ import annotations

import os
import time
from typing import Any, Literal

from mrtr_keys.audit.capture.items import new_item
from mrtr_keys.audit.capture.registry import shared_sink
from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.errors import AuditError

_now = time.time


class SidecarAudit:
    """Callable audit sink for the sidecar (see the module docstring)."""

    def __init__(self, sink: AuditSink, *, strict: bool = False) -> None:
        self.sink = sink
        self.strict = strict
        self.generation: int | None = None
        self._submit = sink.submit

    def __repr__(self) -> str:
        return f"SidecarAudit({self.sink.store.url!r}, strict={self.strict})"

    def __call__(
        self,
        *,
        op: str,
        audience: str | None,
        client: str | None,
        kid: str | None,
        outcome: str,
        reason: str | None,
        token: str | None,
        duration_ms: float,
    ) -> None:
        if self.strict:
            sink = self.sink
            if not sink.healthy:
                raise AuditError(f"the audit store cannot be written: {sink.last_error}")
            if sink.congested:
                raise AuditError("the audit writer is behind (queue past its high-water mark)")
        item = (op, outcome, kid, token, reason, _now(), audience, self.generation, client, duration_ms)
        self._submit(new_item(item))

    def record_many(self, op: str, client: str | None, events: list[tuple[Any, ...]]) -> None:
        """Queue one event per tuple ``(audience, kid, outcome, reason, token, duration_ms, time)``
        (a batch request's items, in order) under one lock. The sidecar uses this for batches only
        when not strict (strict mode checks the writer before each item, `__call__`)."""
        gen = self.generation
        self.sink.submit_many([new_item((op, o, k, t, r, ts, a, gen, client, d)) for a, k, o, r, t, d, ts in events])

    def ring_loaded(self, generation: int, kid: str | None = None) -> None:
        """Record (once per generation: `AuditSink.ring_loaded`) that this sidecar now serves
        `generation`. Called after the switch; never raises: while the store is down the record
        is kept and written in the background as soon as it answers (the new generation is served
        first, the record follows; strict mode refuses requests meanwhile, not reloads)."""
        self.generation = generation
        self.sink.ring_loaded(None, generation, kid, strict=False)

    def ready(self) -> bool:
        """False while the store cannot be written or is silent (``/readyz`` then fails)."""
        return self.sink.healthy

    @property
    def down_since(self) -> float | None:
        """POSIX time since which the store counts as down (`AuditSink.down_since`)."""
        return self.sink.down_since

    def status(self) -> dict[str, object]:
        """The sink's state for ``/readyz`` (`AuditSink.status`)."""
        return self.sink.status()

    def flush(self, timeout: float = 10.0) -> bool:
        """Write everything queued (the sidecar calls this at shutdown)."""
        return self.sink.flush(timeout)

    def close(self) -> None:
        self.sink.close()


def sidecar_audit(
    directory: str | os.PathLike[str], *, audit: str | Literal[False] | None = None, strict: bool = False
) -> SidecarAudit | None:
    """The sidecar's sink for a ring in `directory`: `audit` URL, else ``MRTR_KEYS_AUDIT``, else
    ``audit.db`` beside the ring; None when auditing is off.

    Raises:
        ConfigError, AuditError: bad URL or audit key, or the store cannot be opened.
    """
    from mrtr_keys.audit.writing.stores.url import resolve_url

    url = resolve_url(audit, directory)
    if url is None:
        return None
    sink = shared_sink(url, directory)
    sink.start_writer()  # its memory in place before traffic, not grown into under load
    return SidecarAudit(sink, strict=strict)


def factory(config: Any) -> SidecarAudit | None:
    """``audit_factory = "mrtr_keys.audit.capture.service_sink:factory"``: the default store for the config's ring."""
    from mrtr_keys.keystores import open_keystore

    store = open_keystore(getattr(config, "keystore", None))
    audit = getattr(config, "audit", None)
    return sidecar_audit(store.directory, audit=audit, strict=bool(getattr(config, "strict_audit", False)))
