"""Base of every codec that seals with keys from a key ring (local, KMS envelope, Vault data key).

It loads the ring from a keystore, refuses an audience outside the ring's scope,
turns the usable keys into 32-byte ring keys (`_ring_keys`, the one thing a
subclass supplies) and hands them to the shared `AESGCMTokenCore`. `reload()`
re-reads the keystore and swaps to the new generation atomically; a broken
ring on disk raises and leaves the loaded one in place.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import ClassVar

from mrtr_keys.codecs.aesgcm import AESGCMTokenCore
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.errors import ConfigError
from mrtr_keys.keystores import Keystore, open_keystore
from mrtr_keys.ring.model import KeyRing, KeyState


class KeyRingCodec:
    """A synchronous `RequestStateCodec` over a key ring (see the MCP SDK's `request_state.py`).

    Args:
        keystore: a `Keystore`, a path, or a ``file://`` URL.
        audience: the audience tokens are sealed for (usually the MCP server's name);
            must be in the ring's audience scope.
        observer: optional `CodecObserver` (the audit log).

    Raises:
        KeyRingNotFound, KeystoreError, KeyRingError: the ring cannot be loaded.
        AudienceError: `audience` is outside the ring's scope.
        ConfigError: the ring was made for another codec.
    """

    codec_type: ClassVar[str] = ""

    def __init__(
        self,
        keystore: Keystore | str | os.PathLike[str],
        *,
        audience: str,
        observer: CodecObserver | None = None,
    ) -> None:
        store = open_keystore(keystore) if isinstance(keystore, str | os.PathLike) else keystore
        self._start(store, store.load(), audience=audience, observer=observer)

    @classmethod
    def from_ring(cls, ring: KeyRing, *, audience: str, observer: CodecObserver | None = None) -> KeyRingCodec:
        """A codec over a ring already in memory (no keystore; `reload()` then does nothing)."""
        self = cls.__new__(cls)
        self._start(None, ring, audience=audience, observer=observer)
        return self

    def _start(
        self, keystore: Keystore | None, ring: KeyRing, *, audience: str, observer: CodecObserver | None
    ) -> None:
        """Shared set-up of `__init__` and `from_ring` (subclasses' constructors end here too)."""
        self._keystore = keystore
        self._audience = audience
        self._observer = observer
        self._lock = threading.Lock()
        self._install(ring, self._build(ring))
        self._ring_loaded(ring)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(audience={self._audience!r}, generation={self._ring.generation}, "
            f"primary={self._ring.primary.kid!r})"
        )

    @property
    def audience(self) -> str:
        return self._audience

    @property
    def ring(self) -> KeyRing:
        """The ring as loaded (safe to describe; never print its `to_json()`)."""
        return self._ring

    @property
    def generation(self) -> int:
        return self._ring.generation

    def seal(self, payload: bytes) -> str:
        """Seal `payload` with the ring's primary key; returns a ``mk1.`` token (see `AESGCMTokenCore`)."""
        return self._core.seal(payload)

    def unseal(self, token: str) -> bytes:
        """Unseal a token minted for this audience under a verify or primary key of the loaded ring.

        Raises:
            InvalidRequestState: for every other input, with a short reason code.
        """
        return self._core.unseal(token)

    def reload(self) -> bool:
        """Re-read the keystore; switch to a newer generation. Returns True if it switched.

        Raises:
            KeystoreError, KeyRingError, AudienceError: the stored ring is unusable; the loaded
                ring stays in use.
        """
        if self._keystore is None:
            return False
        ring = self._keystore.load()
        if ring.generation == self._ring.generation and ring == self._ring:
            return False
        core = self._build(ring)
        with self._lock:
            self._install(ring, core)
        self._ring_loaded(ring)
        return True

    def _install(self, ring: KeyRing, core: AESGCMTokenCore) -> None:
        """Switch to `ring`. The core's bound `seal`/`unseal` shadow the methods below on the
        instance, saving a call frame per token; each is a complete codec for the ring it was built
        from, so a caller racing a reload gets the old ring or the new one, never a mix."""
        self._ring, self._core = ring, core
        self.seal = core.seal  # type: ignore[method-assign]
        self.unseal = core.unseal  # type: ignore[method-assign]

    def _ring_loaded(self, ring: KeyRing) -> None:
        """Tell an audit observer (if it has `ring_loaded`) this instance now uses `ring`'s generation;
        it writes synchronously, before construction or `reload` returns (docs/audit.md)."""
        hook = getattr(self._observer, "ring_loaded", None)
        if hook is not None:
            hook(ring.generation, ring.primary.kid)

    def _build(self, ring: KeyRing) -> AESGCMTokenCore:
        if self.codec_type and ring.codec.type != self.codec_type:
            raise ConfigError(
                f"this key ring is for the {ring.codec.type!r} codec, not {self.codec_type!r}; "
                "use mrtr_keys.request_state_security(...) to pick the right one"
            )
        ring.check_audience(self._audience)
        keys = self._ring_keys(ring)
        retired = frozenset(k.kid for k in ring.keys if k.state is KeyState.RETIRED)
        return AESGCMTokenCore(
            keys, primary_kid=ring.primary.kid, audience=self._audience, retired=retired, observer=self._observer
        )

    def _ring_keys(self, ring: KeyRing) -> Mapping[str, bytes]:
        """kid -> 32-byte ring key for every usable key (verify and primary)."""
        raise NotImplementedError
