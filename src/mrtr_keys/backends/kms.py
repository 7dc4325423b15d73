"""AWS KMS envelope backend: each ring key is a KMS data key, stored only in wrapped form.

A key's ``key_data`` (see `mrtr_keys.providers.kms.wrapped.WrappedKey`)::

    {"ciphertext_blob": "<standard base64 of the GenerateDataKey CiphertextBlob>",
     "kms_key_arn": "arn:aws:kms:REGION:ACCOUNT:key/ID",
     "encryption_context": {"mrtr:ring": "r-...", "mrtr:kid": "1a2b3c4d",
                            "mrtr:audiences": "billing,search"}}   # last pair only with a scope

The ring's codec spec records ``{"type": "kms", "kms_key_id": ARN}``; `init` resolves what
the operator passed (key id, ARN or alias) to the key ARN KMS answered with, so the ring
pins one key even if an alias is later moved.

Decision: **the encryption context follows the audience scope.** When `mrtr-keys audience
add/remove` changes the scope, `apply` re-wraps every usable data key with ``ReEncrypt``
(same KMS key, old context -> new context; the plaintext never leaves KMS) before the new
generation is saved, so IAM conditions on ``kms:EncryptionContext:mrtr:audiences`` always
describe the current scope. If KMS refuses, nothing is saved. Retired keys are never
unwrapped again and are left as they are.
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from mrtr_keys.codecs.aesgcm import MK2_PREFIX, TOKEN_PREFIX, describe_token
from mrtr_keys.codecs.kms import KMSEnvelopeCodec
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.errors import ConfigError
from mrtr_keys.keystores import Keystore
from mrtr_keys.providers.kms.client import ENV_KMS_KEY_ID, KMSSettings
from mrtr_keys.providers.kms.service import KMSService
from mrtr_keys.providers.kms.wrapped import checked_wrapped_key, encryption_context, ring_key_id
from mrtr_keys.ring.model import CodecSpec, Key, KeyFormat, KeyRing, KeyState

if TYPE_CHECKING:
    from mypy_boto3_kms import KMSClient


class KMSBackend:
    """Makes data keys with ``GenerateDataKey`` (AES_256) and opens `KMSEnvelopeCodec`.

    Args:
        spec: the ring's codec spec; ``spec.params["kms_key_id"]`` is the wrapping key.
        client: a boto3 KMS client (default: built from the AWS chain, see `mrtr_keys.providers.kms.client`).
        kms_key_id: optional pin (else ``MRTR_KEYS_KMS_KEY_ID``): codecs refuse a ring wrapped
            under any other key.
        connect_timeout, read_timeout: seconds; max_attempts: total tries (see `KMSSettings`).
        kek_check_every: seconds between the codecs' checks of the KMS key (`mrtr_keys.codecs.kek`).
    """

    key_formats = (KeyFormat.MK2, KeyFormat.MK1)

    def __init__(
        self,
        spec: CodecSpec,
        *,
        client: KMSClient | None = None,
        service: KMSService | None = None,
        kms_key_id: str | None = None,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        max_attempts: int | None = None,
        kek_check_every: float | None = None,
    ) -> None:
        self.spec = spec
        self.kek_check_every = kek_check_every
        if service is None:
            settings = KMSSettings.from_env(
                connect_timeout=connect_timeout, read_timeout=read_timeout, max_attempts=max_attempts
            )
            service = KMSService(client, settings)
        self.service = service
        self.pinned = kms_key_id or os.environ.get(ENV_KMS_KEY_ID) or None

    def _key_id(self) -> str:
        key_id = self.spec.params.get("kms_key_id")
        if not isinstance(key_id, str) or not key_id:
            raise ConfigError("the kms codec needs the KMS key to wrap data keys under: --kms-key-id ARN")
        return key_id

    def new_key(self, *, ring_id: str, kid: str, state: KeyState, audiences: tuple[str, ...], now: datetime) -> Key:
        """A new data key from ``GenerateDataKey`` (KeySpec AES_256) under the ring's KMS key; only the
        wrapped form is kept (the plaintext is dropped here and unwrapped by the codec when loaded).

        For the first key (``init``, state primary) the KMS key is first judged with ``DescribeKey``
        exactly as ``rewrap`` judges its target (`mrtr_keys.providers.kms.service.check_wrapping_key`).

        Raises:
            ConfigError: no KMS key configured, not an enabled symmetric encryption key, or KMS
                refused it; BackendUnavailable: KMS unreachable.
        """
        context = encryption_context(ring_id, kid, audiences)
        key_id = self._key_id()
        if state is KeyState.PRIMARY:
            key_id = self.service.key_arn(key_id)
        _plaintext, wrapped = self.service.generate_data_key(key_id, context, kid=kid)
        del _plaintext
        promoted = now if state is KeyState.PRIMARY else None
        return Key(kid=kid, state=state, created_at=now, promoted_at=promoted, key_data=wrapped.to_key_data())

    def apply(self, op: str, before: KeyRing | None, after: KeyRing) -> KeyRing:
        """``init``: record the key ARN KMS resolved. Any op: re-wrap (``ReEncrypt``) every usable key
        whose context no longer matches the ring (an audience change), from `before`'s context.

        Raises:
            UnwrapError: a key's recorded context or KMS key does not match `before`, or KMS refused.
            BackendUnavailable: KMS unreachable (nothing is saved).
        """
        if op == "init" or before is None:
            arn = str(after.primary.key_data.get("kms_key_arn", ""))
            if arn and after.codec.params.get("kms_key_id") != arn:
                after = replace(after, codec=CodecSpec(after.codec.type, {**after.codec.params, "kms_key_id": arn}))
            return after
        key_id = ring_key_id(before)
        keys: list[Key] = []
        changed = False
        for key in after.keys:
            expected = encryption_context(after.ring_id, key.kid, after.audiences)
            if not key.usable or key.key_data.get("encryption_context") == expected:
                keys.append(key)
                continue
            old = before.lookup(key.kid)
            if old is None:  # a key new in `after` is made with the right context; anything else is refused
                checked_wrapped_key(after, key, key_id)
                keys.append(key)
                continue
            source = checked_wrapped_key(before, old, key_id)
            wrapped = self.service.re_encrypt(
                source, source_key_id=key_id, destination_key_id=key_id, context=expected, kid=key.kid
            )
            keys.append(replace(key, key_data=wrapped.to_key_data()))
            changed = True
        return replace(after, keys=tuple(keys)) if changed else after

    def open_codec(
        self, keystore: Keystore, *, audience: str, observer: CodecObserver | None = None
    ) -> KMSEnvelopeCodec:
        """A `KMSEnvelopeCodec` sharing this backend's KMS client (unwraps every usable key now)."""
        return KMSEnvelopeCodec(
            keystore,
            audience=audience,
            observer=observer,
            service=self.service,
            kms_key_id=self.pinned,
            kek_check_every=self.kek_check_every,
        )

    def describe_token(self, ring: KeyRing, token: str) -> dict[str, Any] | None:
        """The same ``mk1.`` / ``mk2.`` formats as the local codec (`describe_token`); None for other prefixes."""
        if not token.startswith((TOKEN_PREFIX, MK2_PREFIX)):
            return None
        return describe_token(ring, token)


def make_backend(spec: CodecSpec, **options: Any) -> KMSBackend:
    """`backend_for` entry point: `KMSBackend`'s keyword options (``BACKEND_OPTIONS["kms"]``)."""
    return KMSBackend(spec, **options)
