"""Single-use requestState: a consume-once store on Redis or PostgreSQL (docs/single-use.md).

`open_store(url)` opens a `ReplayStore`; `ReplayGuard` consumes a token after its codec authenticated
it; `SingleUseCodec` wraps any codec with a guard. `mrtr_keys.request_state_security(single_use=URL)`
wires them for an MCP server, ``mrtr-keys serve --replay-store URL`` for the sidecar.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mrtr_keys.errors import ConfigError, ReplayStoreUnavailable
from mrtr_keys.replay.guard import DeferredObserver, ReplayGuard, ReplayMetrics, SingleUseCodec, Targets
from mrtr_keys.replay.store import ReplayStore, open_store

if TYPE_CHECKING:
    from mcp.server.mcpserver import RequestStateSecurity

__all__ = [
    "DeferredObserver",
    "ReplayGuard",
    "ReplayMetrics",
    "ReplayStore",
    "SingleUseCodec",
    "Targets",
    "defer_observer",
    "open_store",
    "with_single_use",
]


def with_single_use(
    security: RequestStateSecurity,
    single_use: str | ReplayStore | None,
    single_use_for: Iterable[str] | None = None,
    on_store_error: str = "deny",
    *,
    observer: DeferredObserver | None = None,
) -> RequestStateSecurity:
    """`security` with its codec wrapped in a `SingleUseCodec` when `single_use` names a store, else as is.

    Args:
        single_use: a store URL (``redis://HOST:PORT/DB``, ``postgresql://...``) or an open `ReplayStore`.
        single_use_for: limit to these tools / prompts / resource URIs or templates (None: every round).
        on_store_error: ``"deny"`` (fail closed, default) or ``"allow"``.
        observer: the `DeferredObserver` the codec was built with (see `defer_observer`), if any.

    Raises:
        ConfigError: `single_use_for` or `on_store_error` without `single_use`, or a bad value.
    """
    if single_use is None:
        if single_use_for is not None or on_store_error != "deny":
            raise ConfigError("single_use_for and on_store_error need single_use=STORE_URL (docs/single-use.md)")
        return security
    store = open_store(single_use) if isinstance(single_use, str) else single_use
    guard = ReplayGuard(
        store,
        only=single_use_for,
        on_store_error=on_store_error,  # type: ignore[arg-type]
        fallback_ttl=security.ttl,
    )
    try:
        store.hmac_key()  # connect now, not on the first user's round; a store still down is retried then
    except ReplayStoreUnavailable:
        pass
    security.codec = SingleUseCodec(security.codec, guard, observer=observer)
    return security


def defer_observer(options: dict[str, Any], single_use: object) -> DeferredObserver | None:
    """With `single_use` set, wrap ``options["observer"]`` (the audit log's) in a `DeferredObserver`, so an
    unseal is recorded once the guard has decided; returns the wrapper (None if nothing to wrap)."""
    observer = options.get("observer")
    if single_use is None or observer is None:
        return None
    deferred = options["observer"] = DeferredObserver(observer)
    return deferred
