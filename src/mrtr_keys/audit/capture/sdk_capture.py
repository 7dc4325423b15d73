"""Capturing the MCP SDK's own requestState rejections into the audit log.

After our codec has unsealed a token, the SDK's `RequestStateBoundary` still checks the claims
inside (expiry, request binding, audience, principal). When one fails it logs, on the
``mcp.server.request_state`` logger at WARNING, ``"requestState rejected on %s: %s"`` with the
method and the reason, and answers the client only "Invalid or expired requestState".

`RejectionCapture`, a `logging.Handler` on that logger, turns each such line into an ``unseal
rejected`` event with the SDK's reason. The SDK checks the claims synchronously right after the
codec's ``unseal`` (no ``await`` between them, so on the same thread), so the handler finds the
``unseal ok`` item our observer queued a moment before and turns it into the rejection (one event,
with kid and fingerprint). Reasons raised by our codec itself were already recorded by the
observer and are skipped; reasons with no unseal before them (a non-string state, a codec that
raised something else) are recorded without kid or fingerprint.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrtr_keys.audit.capture.observer import AuditObserver

SDK_LOGGER = "mcp.server.request_state"
SDK_MESSAGE = "requestState rejected on %s: %s"
"""The SDK's log format for a rejection (`_reject` in mcp/server/request_state.py)."""

_NO_UNSEAL = frozenset({"non-string requestState", "codec error"})
_MAX_AGE = 1.0  # seconds: an unseal older than this is not the one the SDK is rejecting

CODEC_REJECTED: Any = object()
"""Marker the observer leaves when our codec rejected (the event is already recorded)."""

local = threading.local()
"""`local.last`: (observer, `AuditItem`) of this thread's latest unseal, or `CODEC_REJECTED`."""

_default: weakref.ref[AuditObserver] | None = None
_installed: RejectionCapture | None = None
_lock = threading.Lock()


class RejectionCapture(logging.Handler):
    """Turns the SDK's rejection log lines into ``unseal rejected`` audit events."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.msg != SDK_MESSAGE or not isinstance(record.args, tuple) or len(record.args) != 2:
                return
            reason = str(record.args[1])
            last = getattr(local, "last", None)
            local.last = None
            if last is CODEC_REJECTED:
                return
            if last is not None and reason not in _NO_UNSEAL:
                observer, item = last
                if time.time() - item.time <= _MAX_AGE:
                    observer.sink.retract(item, reason)
                    return
            observer = _default() if _default is not None else None
            if observer is not None:
                observer.sink.record("unseal", outcome="rejected", reason=reason, audience=observer.audience)
        except Exception:  # a logging handler must never raise into the SDK
            self.handleError(record)


def install(observer: AuditObserver) -> None:
    """Attach the capture handler once per process; `observer` records rejections with no unseal
    before them (the most recently installed observer wins)."""
    global _default, _installed
    with _lock:
        _default = weakref.ref(observer)
        if _installed is None:
            _installed = RejectionCapture()
            sdk_logger = logging.getLogger(SDK_LOGGER)
            sdk_logger.addHandler(_installed)
            if not sdk_logger.isEnabledFor(logging.WARNING):
                sdk_logger.setLevel(logging.WARNING)
