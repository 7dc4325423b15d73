"""`KMSEnvelopeCodec`: AES-256-GCM tokens under data keys that AWS KMS wraps.

The ring holds only wrapped data keys (see `mrtr_keys.backends.kms`). Construction (and
`reload()` when the ring changed) unwraps each usable key once with ``Decrypt``; after that
`seal`/`unseal` are the shared `AESGCMTokenCore` (token format ``mk1.``, docs/token-format.md)
and make no KMS call at all, as the MCP SDK's codec contract asks ("cache key material rather
than calling a KMS per token").

Load rule (decision, docs/kms.md): the ring **refuses to load** if any usable key (verify or
primary) fails to unwrap; the codec never runs with a partial ring, so a key that cannot seal
or unseal is never silently skipped or made primary.

The KMS key is checked again every ``kek_check_every`` seconds in the background (`mrtr_keys.codecs.kek`):
one ``Decrypt`` of the primary's data key. A refusal (``DisabledException``, ``KMSInvalidStateException``,
``AccessDeniedException``, ``NotFoundException``, any other 4xx) makes the codec fail closed until KMS
answers again; throttling, 5xx and transport errors are an outage, and it keeps serving.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from mrtr_keys.codecs.base import KeyRingCodec
from mrtr_keys.codecs.kek import check_every, shared_check
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.codecs.pin import RingPin
from mrtr_keys.errors import UnwrapError, WrappingKeyRevoked
from mrtr_keys.keystores import Keystore
from mrtr_keys.providers.kms.client import ENV_KMS_KEY_ID, KMSSettings
from mrtr_keys.providers.kms.service import KMSService
from mrtr_keys.providers.kms.wrapped import checked_wrapped_key, ring_key_id
from mrtr_keys.ring.model import KeyRing

if TYPE_CHECKING:
    from mypy_boto3_kms import KMSClient

_CacheKey = tuple[str, bytes, str, tuple[tuple[str, str], ...]]


class KMSEnvelopeCodec(KeyRingCodec):
    """Seals with the ring's primary data key; unseals with the key the token's kid names.

    Drop-in for the MCP SDK: ``RequestStateSecurity(codec=KMSEnvelopeCodec(path, audience="svc"))``,
    or just ``mrtr_keys.request_state_security(path, audience="svc")`` for a ring made with
    ``mrtr-keys init --codec kms --kms-key-id ARN``.

    Args:
        keystore, audience, observer: as for `KeyRingCodec`.
        client: a boto3 KMS client (default: the standard AWS chain, `mrtr_keys.providers.kms.client.make_client`).
        service: a `KMSService` to share (overrides `client` and `settings`).
        settings: timeouts and retries for the default client.
        kms_key_id: optional pin (else ``MRTR_KEYS_KMS_KEY_ID``): refuse a ring wrapped under any
            other KMS key.
        kek_check_every: seconds between checks of the KMS key (`mrtr_keys.codecs.kek`; None:
            ``MRTR_KEYS_KEK_CHECK_EVERY``, else 300; 0: off).

    Raises:
        UnwrapError: a usable key does not unwrap (context, key id, ciphertext, access denied);
            the message names the kid and the KMS error code.
        BackendUnavailable: KMS unreachable, throttled or 5xx (after the configured timeouts
            and retries).
        ConfigError: no AWS credentials or region, a bad `kek_check_every`; and everything `KeyRingCodec` raises.
    """

    codec_type: ClassVar[str] = "kms"

    def __init__(
        self,
        keystore: Keystore | str | os.PathLike[str],
        *,
        audience: str,
        observer: CodecObserver | None = None,
        client: KMSClient | None = None,
        service: KMSService | None = None,
        settings: KMSSettings | None = None,
        kms_key_id: str | None = None,
        kek_check_every: float | None = None,
    ) -> None:
        self._init_kms(client, service, settings, kms_key_id, kek_check_every)
        super().__init__(keystore, audience=audience, observer=observer)

    @classmethod
    def from_ring(
        cls,
        ring: KeyRing,
        *,
        audience: str,
        observer: CodecObserver | None = None,
        client: KMSClient | None = None,
        service: KMSService | None = None,
        settings: KMSSettings | None = None,
        kms_key_id: str | None = None,
        kek_check_every: float | None = None,
    ) -> KMSEnvelopeCodec:
        """A codec over a ring already in memory (unwraps now; `reload()` then does nothing)."""
        self = cls.__new__(cls)
        self._init_kms(client, service, settings, kms_key_id, kek_check_every)
        self._start(None, ring, audience=audience, observer=observer)
        return self

    def _init_kms(
        self,
        client: KMSClient | None,
        service: KMSService | None,
        settings: KMSSettings | None,
        kms_key_id: str | None,
        kek_check_every: float | None,
    ) -> None:
        self._kms = service or KMSService(client, settings or KMSSettings.from_env())
        self._pinned = kms_key_id or os.environ.get(ENV_KMS_KEY_ID) or None
        if self._pinned:  # a ring of another type or KMS key is refused on reload too, not only at start
            self.pin = RingPin("kms", self._pinned, "kms_key_id" if kms_key_id else ENV_KMS_KEY_ID)
        self._unwrapped: dict[_CacheKey, bytes] = {}
        self._kek_every = check_every(kek_check_every)

    def _start_kek(self) -> None:
        if self._kek_every > 0:  # one check per KMS key and client (its credentials) in this process
            key_id = ring_key_id(self._ring, self._pinned)
            key = ("kms", key_id, id(self._kms.client))
            self.kek = shared_check(key, self, self._kek_every, what=f"KMS key {key_id}")

    def check_wrapping_key(self) -> None:
        """One ``Decrypt`` of the primary's data key (`mrtr_keys.codecs.kek`): the KMS key still answers.

        Raises:
            WrappingKeyRevoked: KMS refused (disabled, pending deletion, not found, access denied, ...).
            BackendUnavailable: KMS unreachable, throttled or 5xx; ConfigError: no credentials.
        """
        ring = self._ring
        key = ring.primary
        try:
            key_id = ring_key_id(ring, self._pinned)
            self._kms.decrypt(checked_wrapped_key(ring, key, key_id), key_id, kid=key.kid)
        except UnwrapError as exc:
            raise WrappingKeyRevoked(f"KMS refused to decrypt the data key of {key.kid}: {exc}") from None

    def _forget_keys(self) -> None:
        self._unwrapped = {}

    def _ring_keys(self, ring: KeyRing) -> Mapping[str, bytes]:
        """One ``Decrypt`` per usable key not already unwrapped from the identical wrapped entry.

        Local checks first (context equals this ring's, recorded key ARN equals the ring's
        KMS key, which equals the pin if any); then ``Decrypt(CiphertextBlob, KeyId,
        EncryptionContext)`` and a check of the returned ``KeyId``. Plaintext data keys are
        kept in memory for the codec's lifetime, only for entries of the current ring, so a
        `reload()` after a rotation step unwraps only the new key.
        """
        key_id = ring_key_id(ring, self._pinned)
        keys: dict[str, bytes] = {}
        cache: dict[_CacheKey, bytes] = {}
        for key in ring.usable_keys():
            wrapped = checked_wrapped_key(ring, key, key_id)
            entry: _CacheKey = (key.kid, wrapped.ciphertext_blob, key_id, tuple(wrapped.context.items()))
            plaintext = self._unwrapped.get(entry)
            if plaintext is None:
                plaintext = self._kms.decrypt(wrapped, key_id, kid=key.kid)
            cache[entry] = plaintext
            keys[key.kid] = plaintext
        self._unwrapped = cache
        return keys
