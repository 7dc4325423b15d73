"""Vault / OpenBao transit backend: each ring key is one version of one transit key.

``Key.key_data`` = ``{"key_version": N}`` (remote mode) or ``{"key_version": N,
"wrapped_key": "vault:vN:..."}`` (datakey mode). How the rotation phases map to
transit (docs/vault.md):

* ``init``: the transit key must exist and be derived; the primary records its
  current ``latest_version`` (and, in datakey mode, a data key wrapped with it).
* ``begin``: ``POST {mount}/keys/{key}/rotate``; the new verify key records the new
  ``latest_version``. Sealing stays pinned to the primary's version because every
  encrypt names its ``key_version``.
* ``promote``: ring only. ``min_encryption_version`` is NOT raised: instances that
  have not reloaded still seal with the old version, and Vault must accept that.
* ``retire``: ``POST {mount}/keys/{key}/config`` raising ``min_encryption_version``
  and ``min_decryption_version`` to the new primary's version (never lowering them).

The rotation state (phase, versions, times, TTL) lives in the key ring document of
the ring's keystore, whose generation compare-and-swap already serialises deploy
runners. Vault is changed before the ring is saved; if the save then loses the CAS,
the Vault change is harmless (an unused extra version after ``begin``; a ``retire``
that the next run repeats idempotently).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from mrtr_keys.codecs.aesgcm import MK2_PREFIX, describe_token
from mrtr_keys.codecs.aesgcm import TOKEN_PREFIX as AESGCM_PREFIX
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.codecs.vault_remote import TOKEN_PREFIX, VERSION_BYTES
from mrtr_keys.codecs.vault_transit import VaultTransitCodec
from mrtr_keys.errors import BackendUnavailable, ConfigError
from mrtr_keys.keystores import Keystore
from mrtr_keys.providers.vault.client import VaultClient, VaultRefused, VaultSettings, latest_version
from mrtr_keys.providers.vault.params import TransitParams, check_transit_key, datakey_context, key_version
from mrtr_keys.ring.model import CodecSpec, Key, KeyFormat, KeyRing, KeyState
from mrtr_keys.token import unpack


class VaultTransitBackend:
    """Key management on a transit key; opens `VaultTransitCodec`.

    Args:
        spec: the ring's codec spec (params ``key``, ``mode``, ``mount``).
        client: a `VaultClient`; default: built on first use from `settings` or the environment.

    Raises:
        ConfigError: invalid params.
    """

    def __init__(
        self,
        spec: CodecSpec,
        *,
        client: VaultClient | None = None,
        settings: VaultSettings | None = None,
        kek_check_every: float | None = None,
    ) -> None:
        self.spec = spec
        self.kek_check_every = kek_check_every
        self.params = TransitParams.from_spec(spec)
        self._client = client
        self._settings = settings
        # datakey mode seals with the shared token core; remote mode's keys are transit versions (Vault's format)
        self.key_formats = (KeyFormat.MK2, KeyFormat.MK1) if self.params.mode == "datakey" else (KeyFormat.MK1,)

    @property
    def client(self) -> VaultClient:
        if self._client is None:
            self._client = VaultClient(self._settings)
        return self._client

    def new_key(self, *, ring_id: str, kid: str, state: KeyState, audiences: tuple[str, ...], now: datetime) -> Key:
        """``init`` (state primary): record the current latest version; ``begin`` (verify): rotate first.

        Raises:
            ConfigError: the transit key is missing, not derived, or the policy forbids the call.
            BackendUnavailable: Vault unreachable.
        """
        p = self.params
        info = check_transit_key(self.client, p)
        try:
            version = latest_version(info) if state is KeyState.PRIMARY else self.client.rotate_key(p.mount, p.key)
            key_data: dict[str, Any] = {"key_version": version}
            if p.mode == "datakey":
                key_data["wrapped_key"] = self.client.datakey_wrapped(
                    p.mount, p.key, context_b64=datakey_context(ring_id, kid), key_version=version
                )
        except VaultRefused as exc:
            raise ConfigError(self._denied("rotate or create a data key with", exc)) from None
        promoted = now if state is KeyState.PRIMARY else None
        return Key(kid=kid, state=state, created_at=now, promoted_at=promoted, key_data=key_data)

    def apply(self, op: str, before: KeyRing | None, after: KeyRing) -> KeyRing:
        """On a retire (a key usable in `before` is retired in `after`), raise the transit key's
        ``min_encryption_version`` and ``min_decryption_version`` to the primary's version.

        The ring diff decides, not `op`, so ``rotate next`` is handled the same way.

        Raises:
            ConfigError: the policy forbids ``{mount}/keys/{key}/config``.
            BackendUnavailable: Vault unreachable (nothing is saved).
        """
        if before is None:
            return after
        was_usable = {k.kid for k in before.keys if k.usable}
        newly_retired = [k for k in after.keys if k.state is KeyState.RETIRED and k.kid in was_usable]
        if not newly_retired:
            return after
        p = self.params
        target = key_version(after.primary)
        try:
            info = self.client.read_key(p.mount, p.key)
            current_enc = _int(info.get("min_encryption_version"))
            current_dec = _int(info.get("min_decryption_version"))
            if current_enc < target or current_dec < target:
                self.client.configure_key(
                    p.mount,
                    p.key,
                    min_encryption_version=max(current_enc, target),
                    min_decryption_version=max(current_dec, target),
                )
        except VaultRefused as exc:
            raise ConfigError(self._denied("configure", exc)) from None
        return after

    def open_codec(
        self, keystore: Keystore, *, audience: str, observer: CodecObserver | None = None
    ) -> VaultTransitCodec:
        return VaultTransitCodec(
            keystore, audience=audience, observer=observer, client=self.client, kek_check_every=self.kek_check_every
        )

    def describe_token(self, ring: KeyRing, token: str) -> dict[str, Any] | None:
        """Format, kid, its state, the transit ``key_version`` and sizes; None for another format.

        Raises:
            MalformedToken: the text has this format's prefix but does not parse.
        """
        if token.startswith(TOKEN_PREFIX):
            raw_kid, body = unpack(TOKEN_PREFIX, token, min_body=VERSION_BYTES)
            kid = raw_kid.hex()
            key = ring.lookup(kid)
            return {
                "format": TOKEN_PREFIX.rstrip("."),
                "kid": kid,
                "state": key.state.value if key is not None else "unknown",
                "transit_key": self.params.key,
                "mount": self.params.mount,
                "key_version": int.from_bytes(body[:VERSION_BYTES], "big"),
                "token_chars": len(token),
                "vault_ciphertext_bytes": len(body) - VERSION_BYTES,
            }
        if token.startswith((AESGCM_PREFIX, MK2_PREFIX)):
            info = describe_token(ring, token)
            key = ring.lookup(info["kid"])
            info["transit_key"] = self.params.key
            info["mount"] = self.params.mount
            info["key_version"] = key.key_data.get("key_version") if key is not None else None
            return info
        return None

    def _denied(self, what: str, exc: VaultRefused) -> str:
        p = self.params
        detail = "; ".join(exc.errors) or "no detail"
        return (
            f"Vault refused to {what} transit key {p.key!r} at {p.mount!r} (HTTP {exc.status}: {detail}); "
            "the deploy role's policy needs update on "
            f"{p.mount}/keys/{p.key}/rotate and {p.mount}/keys/{p.key}/config (see docs/vault.md)"
        )


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BackendUnavailable("Vault's key read has no integer min_*_version")
    return value


def make_backend(
    spec: CodecSpec,
    *,
    client: VaultClient | None = None,
    settings: VaultSettings | None = None,
    kek_check_every: float | None = None,
) -> VaultTransitBackend:
    """The backend for a ``vault-transit`` ring (see `mrtr_keys.backends.backend_for`)."""
    return VaultTransitBackend(spec, client=client, settings=settings, kek_check_every=kek_check_every)
