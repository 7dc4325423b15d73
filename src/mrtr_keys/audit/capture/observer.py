"""`AuditObserver`: the `CodecObserver` (mrtr_keys/codecs/observe.py) that feeds the audit sink.

Its per-token methods only build an `AuditItem` and append it to the sink's queue (see
`mrtr_keys.audit.capture.sink`); fingerprinting and writing happen in the writer. `ring_loaded`
writes synchronously: an instance's ``ring-loaded`` event is in the store before the codec's
construction (or reload) returns, which the promote gate (`mrtr_keys.fleet.gates`) relies on.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal

from mrtr_keys.audit.capture import sdk_capture
from mrtr_keys.audit.capture.items import new_item
from mrtr_keys.audit.capture.registry import shared_sink
from mrtr_keys.audit.capture.sink import AuditSink
from mrtr_keys.audit.events import OK, REJECTED
from mrtr_keys.codecs.fence import FENCED_OUT
from mrtr_keys.codecs.usage import OVER_BUDGET
from mrtr_keys.codecs.usage import over_budget as _over_budget

logger = logging.getLogger("mrtr_keys.audit")
_now = time.time
_local = sdk_capture.local
_CODEC_REJECTED = sdk_capture.CODEC_REJECTED
_new = new_item


class AuditObserver:
    """Records every seal and unseal of one codec (one audience) into `sink`.

    Args:
        sink: the process's `AuditSink` for the store.
        audience: the codec's audience (recorded on every event).
        strict: `ring_loaded` raises `AuditError` when the store cannot be written (else it logs).
    """

    __slots__ = ("__weakref__", "audience", "generation", "kid", "reason", "sink", "strict")

    def __init__(self, sink: AuditSink, *, audience: str, strict: bool = False) -> None:
        self.sink = sink
        self.audience = audience
        self.generation: int | None = None
        self.kid: str | None = None
        self.reason: str | None = None
        """The reason ok events carry: `FENCED_OUT` while the codec serves fenced out (`fenced`), else None."""
        self.strict = strict

    def __repr__(self) -> str:
        return f"AuditObserver(audience={self.audience!r}, store={self.sink.store.url!r})"

    def sealed(self, kid: str, token: str) -> None:
        reason = self.reason or (OVER_BUDGET if kid in _over_budget else None)  # past its seal budget: still sealing
        item = _new(("seal", OK, kid, token, reason, _now(), self.audience, self.generation, None, None))
        self.sink.submit(item)

    def unsealed(self, kid: str, token: str) -> None:
        item = _new(("unseal", OK, kid, token, self.reason, _now(), self.audience, self.generation, None, None))
        self.sink.submit(item)
        _local.last = (self, item)

    def rejected(self, kid: str | None, token: str, reason: str) -> None:
        self.sink.submit(
            _new(("unseal", REJECTED, kid, token, reason, _now(), self.audience, self.generation, None, None))
        )
        _local.last = _CODEC_REJECTED

    def fenced(self, why: str | None) -> None:
        """The codec's fence (`mrtr_keys.codecs.fence.Fence.on_fenced`): while it serves fenced out (`why`
        is not None) its ok events carry the reason `FENCED_OUT`."""
        self.reason = None if why is None else FENCED_OUT

    def ring_loaded(self, generation: int, kid: str | None = None) -> None:
        """Record that this instance now uses key ring `generation` (primary `kid`), synchronously,
        once per process, store, audience and generation (`AuditSink.ring_loaded`).

        Raises:
            AuditError: the store cannot be written and `strict` is set (else it is retried in the
                background until the store is back).
        """
        self.generation, self.kid = generation, kid
        self.sink.ring_loaded(self.audience, generation, kid, strict=self.strict)


def observer_for(
    directory: str | os.PathLike[str] | None,
    *,
    audience: str,
    audit: str | Literal[False] | None = None,
    strict: bool = False,
) -> AuditObserver | None:
    """The observer for a codec whose key ring lives in `directory`, or None when auditing is off.

    `audit`: None for ``MRTR_KEYS_AUDIT`` else the default SQLite file beside the ring; a store
    URL; or False (off). Installs the SDK rejection capture (`mrtr_keys.audit.capture.sdk_capture`).

    Raises:
        ConfigError: a bad URL or audit key; AuditError: the store cannot be opened.
    """
    from mrtr_keys.audit.writing.stores.url import resolve_url

    url = resolve_url(audit, directory)
    if url is None or directory is None:
        return None
    observer = AuditObserver(shared_sink(url, directory), audience=audience, strict=strict)
    sdk_capture.install(observer)
    return observer
