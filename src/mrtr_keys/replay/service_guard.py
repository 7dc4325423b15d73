"""Single-use unseals in the sealing sidecar: ``mrtr-keys serve --replay-store URL`` (docs/single-use.md).

`SidecarReplay` decides which unseals are single-use (every one, or those of the named clients or
audiences) and runs the shared `ReplayGuard` after the codec has opened a token. The request core
turns its answer into the HTTP outcome: nothing (served), ``rejected`` 400 with reason ``replayed`` or
``expired`` (the same body as every bad token, so `SidecarCodec` needs nothing new), or
``unavailable`` 503 ``{"error": "replay_store_unavailable"}`` while the store fails (fail closed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from mcp.server.mcpserver import InvalidRequestState
from prometheus_client import CollectorRegistry

from mrtr_keys.errors import ConfigError, ReplayStoreUnavailable
from mrtr_keys.replay.guard import ReplayGuard, ReplayMetrics, StoreErrorPolicy
from mrtr_keys.replay.store import ReplayStore, open_store

STORE_UNAVAILABLE = "replay store unavailable"
"""The reason (log and audit) of an unseal refused because the store failed."""
PING_WAIT = 0.2
"""Most seconds `SidecarReplay.ready` waits for a ping of the store (the store's last answer to any call is
used after it)."""


class SidecarReplay:
    """Which unseals consume their token, and the guard that does it.

    Args:
        store: a store URL or an open `ReplayStore`.
        clients, audiences: make only these clients' / audiences' unseals single-use (either matching
            is enough); both empty: every unseal.
        on_store_error: ``"deny"`` (default) or ``"allow"``.
        ring_ttl: returns the loaded ring's TTL in seconds (the record lifetime for a payload that is
            not an SDK claims envelope).
        registry: where ``mrtr_keys_single_use_total`` goes (the sidecar's own registry).

    Raises:
        ConfigError: bad URL, names or policy.
    """

    def __init__(
        self,
        store: str | ReplayStore,
        *,
        clients: Iterable[str] = (),
        audiences: Iterable[str] = (),
        on_store_error: StoreErrorPolicy = "deny",
        ring_ttl: Callable[[], float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.clients = frozenset(clients)
        self.audiences = frozenset(audiences)
        if not all(isinstance(n, str) and n for n in (*self.clients, *self.audiences)):
            raise ConfigError("single-use clients and audiences must be non-empty names")
        self.every = not self.clients and not self.audiences
        opened = open_store(store) if isinstance(store, str) else store
        metrics = ReplayMetrics(registry) if registry is not None else None
        self.guard = ReplayGuard(opened, on_store_error=on_store_error, fallback_ttl=ring_ttl(), metrics=metrics)
        self._ring_ttl = ring_ttl
        self._ping_lock = threading.Lock()
        self._pinging: threading.Thread | None = None
        self._answered = True
        try:
            opened.hmac_key()  # connect at start; a store still down is retried on the first unseal
        except ReplayStoreUnavailable:
            pass

    def __repr__(self) -> str:
        return f"SidecarReplay({self.guard!r}, every={self.every})"

    def applies(self, client: str, audience: str) -> bool:
        """True if an unseal by `client` for `audience` consumes its token."""
        return self.every or client in self.clients or audience in self.audiences

    def check(self, token: str, payload: bytes) -> str | None:
        """Consume `token`; None if the unseal may be answered, else the refusal's reason.

        ``replayed`` and ``expired`` are bad tokens (400); `STORE_UNAVAILABLE` is a failed store (503).
        """
        self.guard.set_fallback_ttl(self._ring_ttl())
        try:
            self.guard.check(token, payload)
        except InvalidRequestState as exc:
            return str(exc)
        except ReplayStoreUnavailable:
            return STORE_UNAVAILABLE
        return None

    def ready(self) -> bool:
        """True if the store answers. A ping runs in a thread of its own (one at a time); this waits for
        it at most `PING_WAIT` seconds, so readiness answers in milliseconds whatever the store does.
        A ping still out after that is judged by the store's last answer to any call (a ping or an
        unseal's consume: `down_since`), so a store that came back and served an unseal is ready even
        while a slow ping is under way, and a silent store shows at the latest one ping deadline (1 s)
        later. A store without that health record is judged by its last finished ping."""
        with self._ping_lock:
            pinging = self._pinging
            if pinging is None or not pinging.is_alive():
                pinging = self._pinging = threading.Thread(target=self._ping, name="mrtr-replay-ping", daemon=True)
                pinging.start()
        pinging.join(PING_WAIT)
        if pinging.is_alive() and hasattr(self.guard.store, "down_since"):
            return self.down_since is None
        return self._answered

    def _ping(self) -> None:
        self._answered = self.guard.ready()

    @property
    def down_since(self) -> float | None:
        """POSIX time since which store calls fail (None while they succeed)."""
        since = getattr(self.guard.store, "down_since", None)
        return float(since) if isinstance(since, int | float) and not isinstance(since, bool) else None

    def close(self) -> None:
        self.guard.store.close()
