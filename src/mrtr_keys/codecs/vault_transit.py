"""`VaultTransitCodec`: requestState tokens protected by a HashiCorp Vault / OpenBao transit key.

Two modes, chosen when the ring is created (``mrtr-keys init --codec vault-transit
--transit-key NAME --mode remote|datakey [--mount transit]``) and recorded in it:

* ``remote``: keys never leave Vault; every `seal` is one ``transit/encrypt`` call and every
  `unseal` one ``transit/decrypt`` call, ``mkv1.`` tokens (`mrtr_keys.codecs.vault_remote`).
* ``datakey``: each ring key holds a 256-bit data key from
  ``transit/datakey/wrapped/<key>`` (context = ring id and kid, so a wrapped key is
  bound to its slot); the codec unwraps each usable key once with
  ``transit/decrypt`` and then seals with the shared AES-GCM token core
  (`mrtr_keys.codecs.aesgcm`, ``mk1.`` tokens): no Vault call per token.

Both modes share the key-ring codec lifecycle (`mrtr_keys.codecs.base.KeyRingCodec`): load,
audience check, atomic `reload()` that never goes back a generation, the ring-loaded report.

Each ring key maps to one transit key version (``Key.key_data["key_version"]``).
Rotation (see docs/vault.md): ``begin`` rotates the transit key and records the new
version; ``promote`` only changes the ring; ``retire`` raises the transit key's
``min_encryption_version`` and ``min_decryption_version`` to the new primary's version.

Datakey mode re-checks the transit key every ``kek_check_every`` seconds in the background
(`mrtr_keys.codecs.kek`): one ``transit/decrypt`` of the primary's data key. A refusal (HTTP 4xx after
the client's re-login: 403 for a policy removed, 400 for a deleted key or a version below
``min_decryption_version``) makes the codec fail closed until Vault answers again; 429, 412, 5xx and
transport errors are an outage, and it keeps serving. (Remote mode asks Vault for every token anyway.)

Errors: `unseal` raises the MCP SDK's `InvalidRequestState` for any token it did not
mint unmodified, including every ciphertext Vault refuses (HTTP 4xx: wrong context,
corrupted, version below ``min_decryption_version``), and never asks Vault about a
token whose kid is unknown or retired. Vault unreachable (or 5xx) is
`BackendUnavailable`, raised from `seal` and `unseal` alike; the SDK then fails closed.
API: https://openbao.org/api-docs/secret/transit/ (same in Vault).
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping

from mrtr_keys.codecs.base import KeyRingCodec, TokenCore
from mrtr_keys.codecs.kek import check_every, shared_check
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.codecs.vault_remote import TOKEN_PREFIX, VERSION_BYTES, RemoteTransitCore, TransitEncryptError
from mrtr_keys.errors import BackendUnavailable, ConfigError, KeyRingError, UnwrapError, WrappingKeyRevoked
from mrtr_keys.keystores import Keystore
from mrtr_keys.providers.vault.client import LoginRefused, VaultClient, VaultRefused
from mrtr_keys.providers.vault.params import (
    CODEC_TYPE,
    TransitParams,
    audience_context,
    check_transit_key,
    datakey_context,
    key_version,
    split_vault_ciphertext,
    vault_ciphertext,
)
from mrtr_keys.ring.model import Key, KeyRing

__all__ = [
    "CODEC_TYPE",
    "TOKEN_PREFIX",
    "VERSION_BYTES",
    "TransitEncryptError",
    "TransitParams",
    "VaultTransitCodec",
    "datakey_context",
    "split_vault_ciphertext",
    "vault_ciphertext",
]


class VaultTransitCodec(KeyRingCodec):
    """A synchronous MCP SDK `RequestStateCodec` over a Vault / OpenBao transit key.

    Args:
        keystore: the ring's `Keystore`, a path or a ``file://`` URL; the ring must be
            a ``vault-transit`` ring (its codec params give mount, key and mode).
        audience: the audience tokens are sealed for; in the ring's scope.
        mode: optional ``remote`` / ``datakey`` to assert the ring's mode.
        client: a `VaultClient` (default: one from the VAULT_* / BAO_* environment).
        observer: optional `CodecObserver` (audit); never sees plaintext.
        kek_check_every: datakey mode: seconds between checks of the transit key (`mrtr_keys.codecs.kek`;
            None: ``MRTR_KEYS_KEK_CHECK_EVERY``, else 300; 0: off).

    `remote_per_token` is True in remote mode (one Vault call per token), False in datakey mode.

    Raises:
        ConfigError: not a vault-transit ring, a mode mismatch, or a transit key that is
            missing, not derived or unreadable (the message says how to create one).
        AudienceError: `audience` outside the ring's scope.
        BackendUnavailable: Vault unreachable; UnwrapError: a data key does not unwrap.
    """

    codec_type = CODEC_TYPE
    _mode_asked: str | None = None
    _client_given: VaultClient | None = None

    def __init__(
        self,
        keystore: Keystore | str | os.PathLike[str],
        *,
        audience: str,
        mode: str | None = None,
        client: VaultClient | None = None,
        observer: CodecObserver | None = None,
        kek_check_every: float | None = None,
    ) -> None:
        self._mode_asked = mode
        self._client_given = client
        self._kek_every = check_every(kek_check_every)
        super().__init__(keystore, audience=audience, observer=observer)

    def _configure(self, ring: KeyRing) -> None:
        self._params = TransitParams.from_spec(ring.codec)
        if self._mode_asked is not None and self._mode_asked != self._params.mode:
            raise ConfigError(f"this key ring uses transit mode {self._params.mode!r}, not {self._mode_asked!r}")
        self._client = self._client_given or VaultClient()
        check_transit_key(self._client, self._params)
        self._context = audience_context(self._audience)
        self._unwrapped: dict[tuple[str, str], bytes] = {}
        self.remote_per_token = self._params.mode == "remote"

    def __repr__(self) -> str:
        ring = self._ring
        return (
            f"VaultTransitCodec(mode={self._params.mode!r}, key={self._params.key!r}, audience={self._audience!r}, "
            f"generation={ring.generation}, primary={ring.primary.kid!r})"
        )

    @property
    def mode(self) -> str:
        return self._params.mode

    @property
    def client(self) -> VaultClient:
        return self._client

    def _make_core(self, ring: KeyRing) -> TokenCore:
        if TransitParams.from_spec(ring.codec) != self._params:
            raise ConfigError("the stored key ring now records another codec or transit key; restart to switch")
        if self._params.mode == "datakey":
            return super()._make_core(ring)
        return RemoteTransitCore(
            ring,
            client=self._client,
            params=self._params,
            context=self._context,
            observer=self._observer,
            reload=self._core_after_reload,
        )

    def _core_after_reload(self) -> TokenCore | None:
        """For a refused encrypt: reload once; the new core if the generation changed, else None."""
        return self._core if self.reload() else None

    def _ring_keys(self, ring: KeyRing) -> Mapping[str, bytes]:
        """Datakey mode: unwrap each usable key's data key (one ``transit/decrypt`` each), reusing
        those already unwrapped from the identical wrapped entry; only the current ring's stay in memory."""
        keys: dict[str, bytes] = {}
        cache: dict[tuple[str, str], bytes] = {}
        for key in ring.usable_keys():
            wrapped = key.key_data.get("wrapped_key")
            if not isinstance(wrapped, str):
                raise KeyRingError(f"key {key.kid}: key_data.wrapped_key is missing (datakey mode)")
            slot = (key.kid, wrapped)
            data_key = self._unwrapped.get(slot)
            if data_key is None:
                data_key = self._unwrap(ring, key, wrapped)
            cache[slot] = data_key
            keys[key.kid] = data_key
        self._unwrapped = cache
        return keys

    def _start_kek(self) -> None:
        if self._params.mode == "datakey" and getattr(self, "_kek_every", 0) > 0:
            what = f"Vault transit key {self._params.mount}/keys/{self._params.key}"
            key = ("vault-transit", self._client.settings, self._params.mount, self._params.key)  # and who asks
            self.kek = shared_check(key, self, self._kek_every, what=what)

    def check_wrapping_key(self) -> None:
        """Datakey mode: one ``transit/decrypt`` of the primary's data key (`mrtr_keys.codecs.kek`).

        Raises:
            WrappingKeyRevoked: Vault refused (HTTP 4xx but 412 and 429, after the client's one re-login on a
                403; or the re-login itself refused): a policy without decrypt, a deleted key, a version below
                ``min_decryption_version``.
            BackendUnavailable: Vault unreachable, sealed, 5xx, 412 or 429.
        """
        ring = self._ring
        key = ring.primary
        wrapped = key.key_data.get("wrapped_key")
        if not isinstance(wrapped, str):
            raise KeyRingError(f"key {key.kid}: key_data.wrapped_key is missing (datakey mode)")
        try:
            self._client.decrypt(
                self._params.mount,
                self._params.key,
                ciphertext=wrapped,
                context_b64=datakey_context(ring.ring_id, key.kid),
            )
        except (VaultRefused, LoginRefused) as exc:
            if exc.status in (412, 429):  # an eventual-consistency retry, a rate limit: an outage
                raise BackendUnavailable(str(exc)) from None
            raise WrappingKeyRevoked(f"Vault refused to decrypt the data key of {key.kid}: {exc}") from None

    def _forget_keys(self) -> None:
        self._unwrapped = {}

    def _unwrap(self, ring: KeyRing, key: Key, wrapped: str) -> bytes:
        try:
            version, _ = split_vault_ciphertext(wrapped)
        except ValueError:
            raise KeyRingError(f"key {key.kid}: key_data.wrapped_key is not a vault:vN: ciphertext") from None
        if version != key_version(key):
            raise KeyRingError(f"key {key.kid}: wrapped_key version v{version} differs from key_version")
        try:
            plaintext = self._client.decrypt(
                self._params.mount,
                self._params.key,
                ciphertext=wrapped,
                context_b64=datakey_context(ring.ring_id, key.kid),
            )
        except VaultRefused as exc:
            raise UnwrapError(
                f"key {key.kid}: Vault refused to unwrap its data key (HTTP {exc.status}; a wrong transit key, "
                "a version below min_decryption_version, or a policy without decrypt)"
            ) from None
        try:
            data_key = base64.b64decode(plaintext, validate=True)
        except (binascii.Error, ValueError):
            raise UnwrapError(f"key {key.kid}: the unwrapped data key is not base64") from None
        if len(data_key) != 32:
            raise UnwrapError(f"key {key.kid}: the unwrapped data key is {len(data_key)} bytes, not 32")
        return data_key
