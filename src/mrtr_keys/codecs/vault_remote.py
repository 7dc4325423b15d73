"""The token core of Vault transit's remote mode: every seal and unseal is one transit call.

Keys never leave Vault. `seal` is one ``transit/encrypt/<key>`` call and `unseal` one
``transit/decrypt/<key>`` call, on a **derived** key with ``context`` = standard base64 of the
audience (UTF-8), so a token sealed for one audience never decrypts for another, and with an
explicit ``key_version`` = the transit version of the ring's primary key (transit would otherwise
encrypt with its latest version, which during rotation phase 1 is the version other instances
cannot be assumed to accept yet). Token::

    "mkv1." + base64url(kid[4] || key_version[4, big-endian] || vault_ciphertext)

where ``vault_ciphertext`` is the raw bytes behind Vault's ``vault:vN:<base64>`` (for
aes256-gcm96: nonce[12] || ciphertext || tag[16]). Keeping bytes, not Vault's text, makes the
token canonical (one spelling per token; Go's lenient base64 would accept several) and 25 %
shorter. The version in the token must equal the version the ring records for the kid, and
Vault's answer to an encrypt must carry the version asked for.
API: https://openbao.org/api-docs/secret/transit/ (same in Vault).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import NoReturn

from mrtr_keys.codecs.aesgcm import RETIRED_KID, REVOKED_KID, refused_kids, rejected
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.codecs.usage import usage_for
from mrtr_keys.errors import BackendUnavailable, MrtrKeysError
from mrtr_keys.providers.vault.client import VaultClient, VaultRefused
from mrtr_keys.providers.vault.params import TransitParams, b64, key_version, split_vault_ciphertext, vault_ciphertext
from mrtr_keys.ring.model import KeyRing
from mrtr_keys.token import MAX_TOKEN_CHARS, MalformedToken, kid_to_bytes, pack, unpack

TOKEN_PREFIX = "mkv1."  # noqa: S105 - a format version, not a secret
"""Format version of remote-mode tokens (datakey mode uses the AES-GCM core's ``mk1.``)."""
VERSION_BYTES = 4
"""Width of the transit key version inside a remote token (unsigned, big-endian)."""
MIN_VAULT_CIPHERTEXT_BYTES = 12 + 16
"""Shortest Vault aes256-gcm96 ciphertext: nonce + tag (an empty plaintext)."""


class TransitEncryptError(MrtrKeysError):
    """Vault refused to seal (e.g. the pinned version is below ``min_encryption_version`` even
    after reloading the ring), or answered with another version than the one asked for."""


class RemoteTransitCore:
    """Seal and unseal ``mkv1.`` tokens of one ring generation through transit.

    Args:
        ring: the ring (its usable keys' ``key_version`` must be valid).
        client, params: the Vault client and the ring's transit settings.
        context: the transit derivation context (base64 of the audience).
        observer: optional `CodecObserver`.
        reload: called once when Vault refuses to encrypt; returns the codec's core after a
            reload that switched generation, else None.

    Raises:
        KeyRingError: a usable key has no valid ``key_version``.
    """

    def __init__(
        self,
        ring: KeyRing,
        *,
        client: VaultClient,
        params: TransitParams,
        context: str,
        observer: CodecObserver | None,
        reload: Callable[[], object],
    ) -> None:
        self._client, self._params, self._context = client, params, context
        self._observer = observer
        self._reload = reload
        self._primary = kid_to_bytes(ring.primary.kid)
        self._primary_version = key_version(ring.primary)
        self._versions = {kid_to_bytes(k.kid): (k.kid, key_version(k)) for k in ring.usable_keys()}
        retired, revoked = refused_kids(ring)
        self._refused = {kid_to_bytes(k): RETIRED_KID for k in retired} | {
            kid_to_bytes(k): REVOKED_KID for k in revoked
        }
        usage = usage_for(ring.ring_id)  # counted like every core (`mrtr_keys.codecs.usage`)
        self._tallies = {kid_to_bytes(k.kid): usage.kid(k.kid) for k in ring.keys}
        self._unknown = usage.unknown
        self._sealing = usage.kid(ring.primary.kid)

    def seal(self, payload: bytes) -> str:
        """Seal `payload` with the primary key's transit version; returns a ``mkv1.`` token.

        Raises:
            BackendUnavailable: Vault unreachable.
            TransitEncryptError: Vault refused the pinned version even after one reload of the
                ring, or returned another version than the one asked for.
        """
        try:
            token = self._encrypt(payload)
        except VaultRefused as first:
            # The pinned version may have been retired by a deploy this instance has not
            # loaded yet (min_encryption_version raised): reload once, retry once.
            newer = self._reload()
            if not isinstance(newer, RemoteTransitCore) or newer is self:
                raise TransitEncryptError(self._refusal(first)) from None
            return newer.seal_once(payload)
        self._sealed(token)
        return token

    def seal_once(self, payload: bytes) -> str:
        """`seal` without the reload-and-retry on a refusal."""
        try:
            token = self._encrypt(payload)
        except VaultRefused as exc:
            raise TransitEncryptError(self._refusal(exc)) from None
        self._sealed(token)
        return token

    def unseal(self, token: str) -> bytes:
        """Unseal a token minted for this audience under a verify or primary key of the ring.

        Raises:
            InvalidRequestState: malformed, too long, unknown, retired or revoked kid, version mismatch,
                or refused by Vault (reason codes as in `AESGCMTokenCore`, plus ``version`` and
                ``vault refused``).
            BackendUnavailable: Vault unreachable or answering 5xx.
        """
        try:
            raw_kid, body = unpack(TOKEN_PREFIX, token, min_body=VERSION_BYTES + MIN_VAULT_CIPHERTEXT_BYTES)
        except MalformedToken as exc:
            self._rejected(None, token, str(exc))
        entry = self._versions.get(raw_kid)
        if entry is None:
            self._rejected(raw_kid, token, self._refused.get(raw_kid, "unknown kid"))
        kid, version = entry
        if int.from_bytes(body[:VERSION_BYTES], "big") != version:
            self._rejected(raw_kid, token, "version")
        ciphertext = vault_ciphertext(version, body[VERSION_BYTES:])
        try:
            plaintext = self._client.decrypt(
                self._params.mount, self._params.key, ciphertext=ciphertext, context_b64=self._context
            )
        except VaultRefused:
            self._rejected(raw_kid, token, "vault refused")
        try:
            payload = base64.b64decode(plaintext, validate=True)
        except (binascii.Error, ValueError):
            raise BackendUnavailable("Vault's decrypt answer has a plaintext that is not base64") from None
        self._tallies[raw_kid].unseal()
        if self._observer is not None:
            self._observer.unsealed(kid, token)
        return payload

    def _rejected(self, raw_kid: bytes | None, token: object, reason: str) -> NoReturn:
        self._tallies.get(raw_kid, self._unknown).reject()  # type: ignore[arg-type]
        rejected(self._observer, raw_kid, token, reason)

    def _sealed(self, token: str) -> None:
        tally = self._sealing
        if tally.seal() >= tally.mark:
            tally.wake()
        if self._observer is not None:
            self._observer.sealed(self._primary.hex(), token)

    def _encrypt(self, payload: bytes) -> str:
        version = self._primary_version
        ciphertext = self._client.encrypt(
            self._params.mount,
            self._params.key,
            plaintext_b64=b64(payload),
            context_b64=self._context,
            key_version=version,
        )
        try:
            got, raw = split_vault_ciphertext(ciphertext)
        except ValueError:
            raise TransitEncryptError("Vault's encrypt answer is not a vault:vN: ciphertext") from None
        if got != version:
            raise TransitEncryptError(f"Vault encrypted with transit key version {got}, not the requested {version}")
        token = pack(TOKEN_PREFIX, self._primary, version.to_bytes(VERSION_BYTES, "big") + raw)
        if len(token) > MAX_TOKEN_CHARS:
            raise TransitEncryptError(f"payload too large: the token would exceed {MAX_TOKEN_CHARS} characters")
        return token

    def _refusal(self, exc: VaultRefused) -> str:
        detail = "; ".join(exc.errors) or "no detail"
        return (
            f"Vault refused to encrypt with transit key {self._params.key!r} version {self._primary_version} "
            f"(HTTP {exc.status}: {detail}); check the ring's rotation state (mrtr-keys rotate status) and the policy"
        )
