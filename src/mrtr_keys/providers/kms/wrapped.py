"""What a KMS ring stores for each key, and the local checks made before any KMS call.

Encryption context (AWS KMS Developer Guide, "Encryption context"): every data key of a
ring is bound to ``{"mrtr:ring": ring_id, "mrtr:kid": kid}`` plus
``"mrtr:audiences": ",".join(sorted(scope))`` when the ring has an audience scope, in that
canonical key order (`encryption_context`). KMS authenticates the context with the
wrapped key, so a blob copied to another ring, kid or scope does not unwrap, and IAM
policies can condition ``kms:Decrypt`` on ``kms:EncryptionContext:mrtr:audiences``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from mrtr_keys.errors import ConfigError, UnwrapError
from mrtr_keys.providers.kms.client import ENV_KMS_KEY_ID
from mrtr_keys.ring.model import Key, KeyRing

CONTEXT_RING = "mrtr:ring"
CONTEXT_KID = "mrtr:kid"
CONTEXT_AUDIENCES = "mrtr:audiences"
AUDIENCE_SEPARATOR = ","

DATA_KEY_BYTES = 32
MAX_BLOB_CHARS = 8192
"""A KMS ciphertext blob is at most 6144 bytes (API reference, CiphertextBlob); base64 of that fits."""


def encryption_context(ring_id: str, kid: str, audiences: Sequence[str]) -> dict[str, str]:
    """The canonical encryption context of one data key (see the module docstring).

    Raises:
        ConfigError: an audience contains the separator ``,`` (it would make the context ambiguous).
    """
    context = {CONTEXT_RING: ring_id, CONTEXT_KID: kid}
    if audiences:
        for a in audiences:
            if AUDIENCE_SEPARATOR in a:
                raise ConfigError(f"audience {a!r} contains ','; the kms codec binds the scope as a comma-joined list")
        context[CONTEXT_AUDIENCES] = AUDIENCE_SEPARATOR.join(sorted(audiences))
    return context


def key_arn_matches(configured: str, returned_arn: str) -> bool:
    """True if `returned_arn` (a key ARN from KMS) is the key `configured` names (a key ARN or bare key id)."""
    if configured == returned_arn:
        return True
    return not configured.startswith(("arn:", "alias/")) and returned_arn.endswith(":key/" + configured)


@dataclass(frozen=True, slots=True)
class WrappedKey:
    """A data key as stored in the ring's ``key_data`` (no plaintext)."""

    ciphertext_blob: bytes
    kms_key_arn: str
    context: dict[str, str]

    def to_key_data(self) -> dict[str, Any]:
        """The ``key_data`` object: ``ciphertext_blob`` (standard base64), ``kms_key_arn``,
        ``encryption_context`` (keys in canonical order)."""
        return {
            "ciphertext_blob": base64.b64encode(self.ciphertext_blob).decode("ascii"),
            "kms_key_arn": self.kms_key_arn,
            "encryption_context": dict(self.context),
        }

    @classmethod
    def from_key_data(cls, kid: str, data: Mapping[str, Any]) -> WrappedKey:
        """Parse a key's ``key_data``.

        Raises:
            UnwrapError: a field is missing or malformed (code ``MalformedKeyData``).
        """

        def bad(what: str) -> NoReturn:
            raise UnwrapError(f"key {kid}: cannot unwrap: MalformedKeyData ({what})")

        blob_text = data.get("ciphertext_blob")
        arn = data.get("kms_key_arn")
        context = data.get("encryption_context")
        if not isinstance(blob_text, str) or not blob_text.isascii() or not 0 < len(blob_text) <= MAX_BLOB_CHARS:
            bad("ciphertext_blob must be standard base64 text")
        try:
            blob = base64.b64decode(blob_text, validate=True)
        except (binascii.Error, ValueError):
            bad("ciphertext_blob does not decode as base64")
        if not isinstance(arn, str) or not arn:
            bad("kms_key_arn must be a non-empty string")
        if not isinstance(context, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in context.items()
        ):
            bad("encryption_context must be an object of strings")
        return cls(blob, arn, dict(context))


def ring_key_id(ring: KeyRing, pinned: str | None = None) -> str:
    """The KMS key a ring's data keys must be wrapped under: the ring's recorded ``kms_key_id``,
    which must match `pinned` when the process pins one (``MRTR_KEYS_KMS_KEY_ID`` / ``kms_key_id=``).

    Raises:
        ConfigError: the ring records no KMS key.
        UnwrapError: the ring's key is not the pinned one (code ``KeyIdMismatch``).
    """
    recorded = ring.codec.params.get("kms_key_id")
    if not isinstance(recorded, str) or not recorded:
        raise ConfigError(
            f"key ring {ring.ring_id} records no KMS key; create it with: mrtr-keys init --codec kms --kms-key-id ARN"
        )
    if pinned and not key_arn_matches(pinned, recorded):
        raise UnwrapError(
            f"key ring {ring.ring_id}: cannot unwrap: KeyIdMismatch (the ring's data keys are wrapped under "
            f"{recorded}, but this process accepts only {pinned}; see {ENV_KMS_KEY_ID})"
        )
    return recorded


def checked_wrapped_key(ring: KeyRing, key: Key, key_id: str) -> WrappedKey:
    """A key's wrapped data key, after the local checks that come before any KMS call.

    The recorded context must equal `encryption_context` of this ring (ring id, kid, scope)
    exactly, and the recorded key ARN must be `key_id`. The returned `WrappedKey` carries the
    context derived from the ring, never the recorded one, so a blob copied from another ring
    can only be sent to KMS with this ring's context (and fails there).

    Raises:
        UnwrapError: ``PlaintextInRing``, ``MalformedKeyData``, ``EncryptionContextMismatch`` or
            ``KeyIdMismatch``, naming the kid and (for contexts) the names of the differing pairs.
    """
    if key.material is not None:
        raise UnwrapError(f"key {key.kid}: cannot unwrap: PlaintextInRing (a kms key ring must not hold 'material')")
    wrapped = WrappedKey.from_key_data(key.kid, key.key_data)
    expected = encryption_context(ring.ring_id, key.kid, ring.audiences)
    if wrapped.context != expected:
        names = sorted(
            set(expected) ^ set(wrapped.context)
            | {n for n in set(expected) & set(wrapped.context) if expected[n] != wrapped.context[n]}
        )
        raise UnwrapError(
            f"key {key.kid}: cannot unwrap: EncryptionContextMismatch (recorded pairs {', '.join(names)} "
            f"differ from this ring's context; was the ring or the key edited or copied?)"
        )
    if not key_arn_matches(key_id, wrapped.kms_key_arn):
        raise UnwrapError(
            f"key {key.kid}: cannot unwrap: KeyIdMismatch (recorded as wrapped under {wrapped.kms_key_arn}, "
            f"but the ring's KMS key is {key_id}; run: mrtr-keys rewrap --kms-key-id ARN)"
        )
    return WrappedKey(wrapped.ciphertext_blob, wrapped.kms_key_arn, expected)
