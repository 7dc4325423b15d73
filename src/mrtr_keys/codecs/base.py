"""The one lifecycle of every codec that seals with keys from a key ring (local, KMS, Vault transit).

`KeyRingCodec` loads the ring from a keystore, checks it was made for this codec type,
refuses an audience outside the ring's scope, builds a token core for the ring (`_make_core`:
by default the shared `AESGCMTokenCore` over the 32-byte keys `_ring_keys` returns, with the
MCP SDK's ``v1.`` beside it for a ring adopted from the SDK's keys, `mrtr_keys.codecs.sdk_v1`)
and installs it. Every instance reports the generation it now uses to its observer
(``ring_loaded``), at construction and after each `reload()` that switched, which the promote
gate of the audit log relies on (docs/audit.md).

`reload()` re-reads the keystore and swaps to the new generation atomically. It never goes
back: a stored ring with a lower generation, or with another ``ring_id``, is refused (the
loaded ring stays, a WARNING is logged once, and `reload_refused` says why until a usable ring
is stored again), and so is a ring the codec's `pin` refuses (another codec type or KMS key,
`mrtr_keys.codecs.pin`). A broken ring raises and also leaves the loaded one in place.

`remote_per_token` says whether `seal`/`unseal` may call a remote service (Vault transit in
remote mode): the sealing sidecar runs such codecs in worker threads, and the others inline.

A codec whose keys are wrapped by a remote key (KMS envelope, Vault data keys) re-checks that key in the
background (`kek`, `mrtr_keys.codecs.kek`) and, when it is disabled or denied, fails closed (`fail_closed`:
its data keys are dropped and a core that refuses everything is installed) until it answers again
(`serve_again`). `on_rejected`, when set (`mrtr_keys.open_codec` sets a metric's), is told the reason code
of every token this codec refuses.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar, Protocol

import mrtr_keys.tracing as tracing
from mrtr_keys.codecs.aesgcm import rejected
from mrtr_keys.codecs.fence import FENCED_OUT_TOO_LONG, UNKNOWN_KID, Fence, FencedOutTooLong
from mrtr_keys.codecs.generations import SWITCH, next_ring
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.codecs.pin import RingPin
from mrtr_keys.codecs.sdk_v1 import build_core
from mrtr_keys.errors import ConfigError
from mrtr_keys.keystores import Keystore, as_keystore
from mrtr_keys.keystores.watch import lease_clock
from mrtr_keys.ring.model import KeyRing

if TYPE_CHECKING:
    from mrtr_keys.codecs.kek import KekCheck

log = logging.getLogger("mrtr_keys.codecs")


class TokenCore(Protocol):
    """A complete codec for one ring generation: what `KeyRingCodec` installs."""

    def seal(self, payload: bytes) -> str: ...

    def unseal(self, token: str) -> bytes: ...


class KeyRingCodec:
    """A synchronous `RequestStateCodec` over a key ring (see the MCP SDK's `request_state.py`).

    Args:
        keystore: a `Keystore`, a path, or a ``file://`` URL.
        audience: the audience tokens are sealed for (usually the MCP server's name);
            must be in the ring's audience scope.
        observer: optional `CodecObserver` (the audit log); its ``ring_loaded(generation, kid)`` is
            called with every generation this instance starts using.

    Raises:
        KeyRingNotFound, KeystoreError, KeyRingError: the ring cannot be loaded.
        AudienceError: `audience` is outside the ring's scope.
        ConfigError: the ring was made for another codec.
    """

    codec_type: ClassVar[str] = ""
    remote_per_token: bool = False
    """True if `seal`/`unseal` may do I/O per token (then keep them off an event loop)."""
    reload_refused: str | None = None
    """Why the last `reload()` kept the loaded ring although the keystore holds another one
    (lower generation, other ring), else None."""
    pin: RingPin | None = None
    """The process's codec pin (`mrtr_keys.codecs.pin`): `reload()` refuses a ring it refuses. Set by
    `mrtr_keys.open_codec` (``expect_codec=``, ``kms_key_id=`` or their environment variables), and by
    `KMSEnvelopeCodec` for its own ``kms_key_id``."""
    _fence: Fence | None = None
    _until: float = math.inf
    """`lease_clock` time after which `seal`/`unseal` ask the fence first (inf: no fence)."""
    kek: KekCheck | None = None
    """The background check of the ring's wrapping key (`mrtr_keys.codecs.kek`), None for a codec without one."""
    on_rejected: Callable[[str], object] | None = None
    """Told the reason code of every token `unseal` refuses (a metric); None: nobody."""
    _closed: str | None = None

    def __init__(
        self,
        keystore: Keystore | str | os.PathLike[str],
        *,
        audience: str,
        observer: CodecObserver | None = None,
    ) -> None:
        store = as_keystore(keystore)
        self._start(store, tracing.load_ring(store), audience=audience, observer=observer)

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
        self._check_type(ring)
        self._configure(ring)
        self._install(ring, self._build(ring))
        self._ring_loaded(ring)
        self._start_kek()

    def _start_kek(self) -> None:
        """Start the wrapping key's background check (`kek`); default: none (no wrapping key)."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(audience={self._audience!r}, generation={self._ring.generation}, "
            f"primary={self._ring.primary.kid!r})"
        )

    @property
    def fence(self) -> Fence | None:
        """The instance's self-fencing lease and unknown-kid look (`mrtr_keys.codecs.fence`); set by
        `mrtr_keys.open_codec` with the ring watcher. None (a codec built alone): neither applies."""
        return self._fence

    @fence.setter
    def fence(self, fence: Fence | None) -> None:
        self._fence = fence
        self._until = math.inf if fence is None else fence.until

    def _ask_fence(self) -> None:
        """The lease ran out, or was last seen to: `Fence.ensure`, then the new end of the lease."""
        fence = self._fence
        if fence is not None:
            fence.ensure()
            self._until = fence.until

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
        """Seal `payload` with the current primary key; returns a token (see the codec's format).

        An ordinary method that reaches the core installed last, so a bound method kept by a caller
        (``seal = codec.seal``) seals with the new primary after a reload too.

        With a `fence` whose lease ran out, it first checks the keystore (and switches generation if
        there is a newer one), waiting for that check at most `Fence.wait` (1 s): the one time a local
        codec waits on I/O in the caller's thread, after a pause or while the keystore is unreachable."""
        if lease_clock() >= self._until:  # the lease ran out (or was last seen to): one comparison
            self._ask_fence()
        return self._seal(payload)

    def unseal(self, token: str) -> bytes:
        """Unseal a token minted for this audience under a verify or primary key of the loaded ring.

        Raises:
            InvalidRequestState: for every other input, with a short reason code.

        With a `fence`: the lease is checked first, as in `seal`; and a token whose kid the loaded ring
        does not know makes one rate-limited keystore check (`Fence.look_again`) and is tried once more
        if the ring changed (the audit log then shows the first attempt's ``unknown kid`` and the result).
        """
        if lease_clock() >= self._until:
            try:
                self._ask_fence()
            except FencedOutTooLong:
                self._count(FENCED_OUT_TOO_LONG)
                rejected(self._observer, None, token, FENCED_OUT_TOO_LONG)
        unseal = self._unseal
        try:
            return unseal(token)
        except Exception as exc:  # the SDK's InvalidRequestState, imported lazily (see codecs.aesgcm.reject)
            fence = self._fence
            if (
                fence is None
                or str(exc) != UNKNOWN_KID
                or not _invalid(exc)
                or not fence.look_again(unseal, lambda: self._unseal)  # the core in use changed: a new ring
            ):
                self._count_rejection(exc)
                raise
        try:
            return self._unseal(token)
        except Exception as exc:
            self._count_rejection(exc)
            raise

    def _count_rejection(self, exc: Exception) -> None:
        if self.on_rejected is not None and _invalid(exc):
            self._count(str(exc))

    def _count(self, reason: str) -> None:
        hook = self.on_rejected
        if hook is not None:
            hook(reason)

    def fail_closed(self, reason: str) -> None:
        """Refuse everything from now on (`mrtr_keys.codecs.kek`: the wrapping key is disabled or denied):
        the data keys are dropped, `seal` raises `WrappingKeyRevoked` and `unseal` refuses every token with
        the reason ``wrapping key revoked``, until `serve_again`. A reload meanwhile stays closed."""
        with self._lock:
            self._closed = reason
            self._forget_keys()
            self._install(self._ring, self._core)

    def serve_again(self) -> None:
        """Rebuild the loaded ring's core (one unwrap per usable key) and serve with it again.

        Raises:
            WrappingKeyRevoked, UnwrapError, BackendUnavailable: a key still does not unwrap (still closed).
        """
        with self._lock:
            core = self._build(self._ring)
            self._closed = None
            self._install(self._ring, core)

    def _forget_keys(self) -> None:
        """Drop every plaintext data key this codec caches (called when it fails closed; default: none)."""

    def reload(self) -> bool:
        """Re-read the keystore; switch to a newer generation of the same ring. Returns True if it switched.

        A stored ring with a lower generation or another ``ring_id`` is not loaded: this returns
        False, logs a WARNING (once per distinct reason) and sets `reload_refused`.

        Raises:
            KeystoreError, KeyRingError, AudienceError, ConfigError: the stored ring is unusable;
                and whatever the codec's backend raises building its keys (BackendUnavailable,
                UnwrapError). The loaded ring stays in use whenever this raises.
        """
        if self._keystore is None:
            return False
        with (
            tracing.span("mrtr_keys.reload", codec=self.codec_type, generation=self._ring.generation) as sp,
            self._lock,  # one reload at a time, so an older ring can never be installed last
        ):
            ring = tracing.load_ring(self._keystore)
            step = next_ring(self._ring, ring, refused_before=self.reload_refused, log=log, pin=self.pin)
            if step.outcome != SWITCH:
                self.reload_refused = step.refused
                tracing.set_attributes(sp, outcome=step.outcome)
                return False
            self._install(ring, self._build(ring))
            self.reload_refused = None
            self._ring_loaded(ring)
            tracing.set_attributes(sp, outcome="switched", to_generation=ring.generation)
        return True

    def _install(self, ring: KeyRing, core: TokenCore) -> None:
        """Switch to `ring`: `seal` and `unseal` reach the new core's (traced) functions. Each core is a
        complete codec for the ring it was built from, so one operation racing a reload runs on the old
        ring or the new one, never a mix; `unseal` is switched first, so a token the new primary sealed
        always meets a core that knows its kid. While the codec fails closed, the core installed refuses
        everything (`mrtr_keys.codecs.kek.ClosedCore`) whatever `core` is."""
        self._ring, self._core = ring, core
        if self._closed is not None:
            from mrtr_keys.codecs.kek import ClosedCore

            core = ClosedCore(self._closed, self._observer)
        seal, unseal = tracing.traced_codec(
            self.codec_type or "ring", self._audience, ring.primary.kid, core.seal, core.unseal
        )
        self._unseal = unseal
        self._seal = seal

    def _ring_loaded(self, ring: KeyRing) -> None:
        """Tell the observer this instance now uses `ring`'s generation; the audit observer writes
        synchronously, before construction or `reload` returns (docs/audit.md)."""
        if self._observer is not None:
            self._observer.ring_loaded(ring.generation, ring.primary.kid)

    def _check_type(self, ring: KeyRing) -> None:
        if self.codec_type and ring.codec.type != self.codec_type:
            raise ConfigError(
                f"this key ring is for the {ring.codec.type!r} codec, not {self.codec_type!r}; "
                "use mrtr_keys.request_state_security(...) to pick the right one"
            )

    def _build(self, ring: KeyRing) -> TokenCore:
        """Check `ring` (codec type, audience scope) and build its core; raises, changing nothing, if unusable."""
        self._check_type(ring)
        ring.check_audience(self._audience)
        return self._make_core(ring)

    def _configure(self, ring: KeyRing) -> None:
        """Read per-instance settings from the first ring, before its core is built (default: none)."""

    def _make_core(self, ring: KeyRing) -> TokenCore:
        """The token core for `ring`: by default the AES-GCM core over `_ring_keys(ring)`; for a ring
        holding MCP SDK keys (adopted from ``keys=[...]``), one that seals in the primary's format and
        opens each token by its prefix (`mrtr_keys.codecs.sdk_v1.build_core`)."""
        return build_core(ring, self._ring_keys(ring), audience=self._audience, observer=self._observer)

    def _ring_keys(self, ring: KeyRing) -> Mapping[str, bytes]:
        """kid -> 32-byte ring key for every usable key (verify and primary)."""
        raise NotImplementedError


def _invalid(exc: Exception) -> bool:
    from mcp.server.mcpserver import InvalidRequestState

    return isinstance(exc, InvalidRequestState)
