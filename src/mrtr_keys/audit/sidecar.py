"""The sidecar's audit sink: plugs the audit log into `mrtr_keys.service.app.create_app(audit=...)`.

The sidecar calls the sink once per operation with ``op``, ``audience``, ``client``, ``kid``,
``outcome``, ``reason``, ``token`` (fingerprinted in the writer thread, never stored) and
``duration_ms``; `SidecarAudit` queues that as one event. It also records ``ring-loaded``
synchronously at start and on every reload that switches generation.

Strict mode (``strict_audit = true``): while the store cannot be written, a call raises
`AuditError`, so the sidecar answers 503 instead of sealing or unsealing unrecorded; `ready()`
is False then in either mode, so ``/readyz`` fails.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from mrtr_keys.audit.events import OK, OP_RING_LOADED, AuditEvent, format_ts, instance_id
from mrtr_keys.audit.sink import AuditSink, shared_sink
from mrtr_keys.errors import AuditError


class SidecarAudit:
    """Callable audit sink for the sidecar (see the module docstring)."""

    def __init__(self, sink: AuditSink, *, strict: bool = False) -> None:
        self.sink = sink
        self.strict = strict
        self.generation: int | None = None
        self._loaded: set[int] = set()

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
        if self.strict and not self.sink.healthy:
            raise AuditError(f"the audit store cannot be written: {self.sink.last_error}")
        self.sink.record(
            op,
            outcome=outcome,
            audience=audience,
            client=client,
            kid=kid,
            reason=reason,
            token=token,
            duration_ms=duration_ms,
            generation=self.generation,
        )

    def ring_loaded(self, generation: int, kid: str | None = None) -> None:
        """Record (synchronously, once per generation) that this sidecar now serves `generation`.

        Raises:
            AuditError: the store cannot be written and `strict` is set.
        """
        self.generation = generation
        if generation in self._loaded:
            return
        event = AuditEvent(
            time=format_ts(_now()),
            instance=instance_id(),
            op=OP_RING_LOADED,
            outcome=OK,
            kid=kid,
            generation=generation,
        )
        try:
            self.sink.write_now([event])
        except AuditError:
            if self.strict:
                raise
            return
        self._loaded.add(generation)

    def ready(self) -> bool:
        """False while the store cannot be written (``/readyz`` then fails)."""
        return self.sink.healthy

    def flush(self, timeout: float = 10.0) -> bool:
        """Write everything queued (the sidecar calls this at shutdown)."""
        return self.sink.flush(timeout)

    def close(self) -> None:
        self.sink.close()


def _now() -> float:
    import time

    return time.time()


def sidecar_audit(
    directory: str | os.PathLike[str], *, audit: str | Literal[False] | None = None, strict: bool = False
) -> SidecarAudit | None:
    """The sidecar's sink for a ring in `directory`: `audit` URL, else ``MRTR_KEYS_AUDIT``, else
    ``audit.db`` beside the ring; None when auditing is off.

    Raises:
        ConfigError, AuditError: bad URL or audit key, or the store cannot be opened.
    """
    from mrtr_keys.audit.stores.url import resolve_url

    url = resolve_url(audit, directory)
    if url is None:
        return None
    return SidecarAudit(shared_sink(url, directory), strict=strict)


def factory(config: Any) -> SidecarAudit | None:
    """``audit_factory = "mrtr_keys.audit.sidecar:factory"``: the default store for the config's ring."""
    from mrtr_keys.keystores import open_keystore

    store = open_keystore(getattr(config, "keystore", None))
    return sidecar_audit(store.directory, strict=bool(getattr(config, "strict_audit", False)))
