"""The hook a codec calls after each seal and unseal (the audit log plugs in here).

An observer receives the kid, the token text (to fingerprint; never to store)
and, for rejections, the reason code. It never receives the payload. It must
not block: the audit sink queues and returns.
"""

from __future__ import annotations

from typing import Protocol


class CodecObserver(Protocol):
    """Receives one call per codec operation; must return quickly and never raise."""

    def sealed(self, kid: str, token: str) -> None: ...

    def unsealed(self, kid: str, token: str) -> None: ...

    def rejected(self, kid: str | None, token: str, reason: str) -> None: ...

    def ring_loaded(self, generation: int, kid: str | None = None) -> None:
        """The codec now seals with `kid`, the primary of key ring `generation` (called at construction
        and after every reload that switches generation). The audit observer writes ``ring-loaded``
        synchronously here, which the promote gate relies on (docs/audit.md); others may do nothing."""
        ...
