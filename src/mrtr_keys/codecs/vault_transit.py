"""`VaultTransitCodec`: requestState tokens protected by a HashiCorp Vault / OpenBao transit key.

Two modes, chosen when the ring is created (``mrtr-keys init --codec vault-transit
--transit-key NAME --mode remote|datakey [--mount transit]``) and recorded in it:

* ``remote``: keys never leave Vault. Every `seal` is one ``transit/encrypt/<key>``
  call and every `unseal` one ``transit/decrypt/<key>`` call, on a **derived** key
  (``derived=true``) with ``context`` = standard base64 of the audience (UTF-8), so a
  token sealed for one audience never decrypts for another, and with an explicit
  ``key_version`` = the transit version of the ring's primary key (transit would
  otherwise encrypt with its latest version, which during rotation phase 1 is the
  version other instances cannot be assumed to accept yet). Token::

      "mkv1." + base64url(kid[4] || key_version[4, big-endian] || vault_ciphertext)

  where ``vault_ciphertext`` is the raw bytes behind Vault's ``vault:vN:<base64>``
  (for aes256-gcm96: nonce[12] || ciphertext || tag[16]). Keeping bytes, not Vault's
  text, makes the token canonical (one spelling per token; Go's lenient base64
  would accept several) and 25 % shorter. The version in the token must equal the
  version the ring records for the kid, and Vault's answer to an encrypt must carry
  the version asked for.

* ``datakey``: each ring key holds a 256-bit data key from
  ``transit/datakey/wrapped/<key>`` (context = ring id and kid, so a wrapped key is
  bound to its slot); the codec unwraps each usable key once with
  ``transit/decrypt`` and then seals with the shared AES-GCM token core
  (`mrtr_keys.codecs.aesgcm`, ``mk1.`` tokens): no Vault call per token.

Each ring key maps to one transit key version (``Key.key_data["key_version"]``).
Rotation (see docs/vault.md): ``begin`` rotates the transit key and records the new
version; ``promote`` only changes the ring; ``retire`` raises the transit key's
``min_encryption_version`` and ``min_decryption_version`` to the new primary's version.

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
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

from mrtr_keys.backends.vault.client import VaultClient, VaultRefused
from mrtr_keys.codecs.aesgcm import AESGCMTokenCore, reject
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.errors import BackendUnavailable, ConfigError, KeyRingError, MrtrKeysError, UnwrapError
from mrtr_keys.keystores import Keystore, open_keystore
from mrtr_keys.ring.model import CodecSpec, Key, KeyRing, KeyState
from mrtr_keys.token import MAX_TOKEN_CHARS, MalformedToken, kid_to_bytes, pack, unpack

CODEC_TYPE = "vault-transit"
TOKEN_PREFIX = "mkv1."  # noqa: S105 - a format version, not a secret
"""Format version of remote-mode tokens (datakey mode uses the AES-GCM core's ``mk1.``)."""

MODES = ("remote", "datakey")
DEFAULT_MOUNT = "transit"
VERSION_BYTES = 4
"""Width of the transit key version inside a remote token (unsigned, big-endian)."""
MIN_VAULT_CIPHERTEXT_BYTES = 12 + 16
"""Shortest Vault aes256-gcm96 ciphertext: nonce + tag (an empty plaintext)."""
DATAKEY_CONTEXT_INFO = "mrtr-keys/v1/vault-datakey"
"""Prefix of the derivation context that binds a wrapped data key to its ring and kid."""

_VAULT_CIPHERTEXT = re.compile(r"vault:v([1-9][0-9]{0,9}):([A-Za-z0-9+/]*={0,2})")
_TRANSIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_MOUNT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./-]{0,127}")


@dataclass(frozen=True)
class TransitParams:
    """A ring's transit settings (from its `CodecSpec`): mount path, key name, mode."""

    mount: str
    key: str
    mode: str

    @classmethod
    def from_spec(cls, spec: CodecSpec) -> TransitParams:
        """Validate ``{"key", "mode", "mount"}``.

        Raises:
            ConfigError: missing or malformed key name, unknown mode, bad mount path.
        """
        key = spec.params.get("key")
        mode = spec.params.get("mode", "remote")
        mount = spec.params.get("mount", DEFAULT_MOUNT)
        if not isinstance(key, str) or _TRANSIT_NAME.fullmatch(key) is None:
            raise ConfigError("the vault-transit codec needs --transit-key NAME (letters, digits, '_', '-', '.')")
        if mode not in MODES:
            raise ConfigError(f"--mode must be remote or datakey, not {mode!r}")
        if not isinstance(mount, str) or _MOUNT.fullmatch(mount.strip("/")) is None or ".." in mount:
            raise ConfigError(f"--mount {mount!r} is not a Vault mount path")
        return cls(mount=mount.strip("/"), key=key, mode=mode)


def b64(data: bytes) -> str:
    """Standard, padded base64 (RFC 4648 section 4): what transit expects for plaintext and context."""
    return base64.b64encode(data).decode("ascii")


def audience_context(audience: str) -> str:
    """Transit derivation ``context`` for remote-mode tokens: base64 of the audience (UTF-8)."""
    return b64(audience.encode("utf-8", "surrogatepass"))


def datakey_context(ring_id: str, kid: str) -> str:
    """Transit derivation ``context`` for a wrapped data key: binds it to one ring and kid."""
    return b64(f"{DATAKEY_CONTEXT_INFO}:{ring_id}:{kid}".encode())


def vault_ciphertext(version: int, raw: bytes) -> str:
    """Vault's text form ``vault:v{version}:{base64(raw)}``."""
    return f"vault:v{version}:{b64(raw)}"


def split_vault_ciphertext(text: str) -> tuple[int, bytes]:
    """Parse ``vault:vN:<base64>`` strictly into (N, raw bytes).

    Raises:
        ValueError: anything else (non-canonical base64 included).
    """
    match = _VAULT_CIPHERTEXT.fullmatch(text)
    if match is None:
        raise ValueError("not a vault:vN: ciphertext")
    try:
        raw = base64.b64decode(match.group(2), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("ciphertext is not base64") from None
    if b64(raw) != match.group(2):
        raise ValueError("ciphertext base64 is not canonical")
    return int(match.group(1)), raw


def key_version(key: Key) -> int:
    """The transit key version a ring key maps to (``key_data["key_version"]``).

    Raises:
        KeyRingError: missing or not a positive integer.
    """
    version = key.key_data.get("key_version")
    if isinstance(version, bool) or not isinstance(version, int) or not (0 < version < 2**32):
        raise KeyRingError(f"key {key.kid}: key_data.key_version must be a positive integer (transit key version)")
    return version


def create_key_hint(params: TransitParams) -> str:
    """How to create a suitable transit key, for error messages."""
    return (
        f"create one with: bao write -f {params.mount}/keys/{params.key} derived=true "
        f"(vault write ... for Vault; or hvac: client.secrets.transit.create_key({params.key!r}, derived=True, "
        f"mount_point={params.mount!r}))"
    )


def check_transit_key(client: VaultClient, params: TransitParams) -> Mapping[str, Any]:
    """Read the transit key and refuse one this codec cannot use safely; returns the key info.

    Raises:
        ConfigError: no such key, no permission to read it, not derived, convergent, or not an
            encryption key; the message says how to create a suitable one.
        BackendUnavailable: Vault unreachable.
    """
    try:
        info = client.read_key(params.mount, params.key)
    except VaultRefused as exc:
        if exc.status == 404:
            raise ConfigError(
                f"transit key {params.key!r} does not exist at mount {params.mount!r}; {create_key_hint(params)}"
            ) from None
        raise ConfigError(
            f"cannot read transit key {params.key!r} at {params.mount!r} (HTTP {exc.status}); the Vault policy "
            f"needs 'read' on {params.mount}/keys/{params.key} (see docs/vault.md)"
        ) from None
    if info.get("derived") is not True:
        raise ConfigError(
            f"transit key {params.key!r} is not derived, so tokens could not be bound to an audience; "
            f"{create_key_hint(params)}"
        )
    if info.get("convergent_encryption") is True:
        raise ConfigError(
            f"transit key {params.key!r} uses convergent encryption (deterministic); {create_key_hint(params)}"
        )
    if info.get("supports_encryption") is False or info.get("supports_derivation") is False:
        raise ConfigError(f"transit key {params.key!r} cannot encrypt with derivation; {create_key_hint(params)}")
    return info


class TransitEncryptError(MrtrKeysError):
    """Vault refused to seal (e.g. the pinned version is below ``min_encryption_version`` even
    after reloading the ring), or answered with another version than the one asked for."""


@dataclass(frozen=True)
class _RemoteState:
    ring: KeyRing
    primary: bytes
    primary_version: int
    versions: Mapping[bytes, tuple[str, int]]
    retired: frozenset[bytes]


@dataclass(frozen=True)
class _DataKeyState:
    ring: KeyRing
    core: AESGCMTokenCore


class VaultTransitCodec:
    """A synchronous MCP SDK `RequestStateCodec` over a Vault / OpenBao transit key.

    Args:
        keystore: the ring's `Keystore`, a path or a ``file://`` URL; the ring must be
            a ``vault-transit`` ring (its codec params give mount, key and mode).
        audience: the audience tokens are sealed for; in the ring's scope.
        mode: optional ``remote`` / ``datakey`` to assert the ring's mode.
        client: a `VaultClient` (default: one from the VAULT_* / BAO_* environment).
        observer: optional `CodecObserver` (audit); never sees plaintext.

    Raises:
        ConfigError: not a vault-transit ring, a mode mismatch, or a transit key that is
            missing, not derived or unreadable (the message says how to create one).
        AudienceError: `audience` outside the ring's scope.
        BackendUnavailable: Vault unreachable; UnwrapError: a data key does not unwrap.
    """

    codec_type: ClassVar[str] = CODEC_TYPE

    def __init__(
        self,
        keystore: Keystore | str | os.PathLike[str],
        *,
        audience: str,
        mode: str | None = None,
        client: VaultClient | None = None,
        observer: CodecObserver | None = None,
    ) -> None:
        self._keystore: Keystore = open_keystore(keystore) if isinstance(keystore, str | os.PathLike) else keystore
        self._audience = audience
        self._context = audience_context(audience)
        self._observer = observer
        self._lock = threading.Lock()
        self._unwrapped: dict[tuple[str, str], bytes] = {}
        ring = self._keystore.load()
        if ring.codec.type != CODEC_TYPE:
            raise ConfigError(
                f"this key ring is for the {ring.codec.type!r} codec, not {CODEC_TYPE!r}; "
                "use mrtr_keys.request_state_security(...) to pick the right one"
            )
        self._params = TransitParams.from_spec(ring.codec)
        if mode is not None and mode != self._params.mode:
            raise ConfigError(f"this key ring uses transit mode {self._params.mode!r}, not {mode!r}")
        self._client = client or VaultClient()
        check_transit_key(self._client, self._params)
        self._state: _RemoteState | _DataKeyState = self._build(ring)

    def __repr__(self) -> str:
        ring = self._state.ring
        return (
            f"VaultTransitCodec(mode={self._params.mode!r}, key={self._params.key!r}, audience={self._audience!r}, "
            f"generation={ring.generation}, primary={ring.primary.kid!r})"
        )

    @property
    def mode(self) -> str:
        return self._params.mode

    @property
    def audience(self) -> str:
        return self._audience

    @property
    def ring(self) -> KeyRing:
        """The ring as loaded (safe to describe; never print its `to_json()`)."""
        return self._state.ring

    @property
    def generation(self) -> int:
        return self._state.ring.generation

    @property
    def client(self) -> VaultClient:
        return self._client

    # -- the codec contract ----------------------------------------------------------------

    def seal(self, payload: bytes) -> str:
        """Seal `payload` for this audience with the primary key's transit version.

        Returns a ``mkv1.`` token (remote) or ``mk1.`` token (datakey).

        Raises:
            BackendUnavailable: Vault unreachable (remote mode).
            TransitEncryptError: Vault refused the pinned version even after one reload of the
                ring, or returned another version than the one asked for.
        """
        state = self._state
        if isinstance(state, _DataKeyState):
            return state.core.seal(payload)
        try:
            token = self._encrypt(state, payload)
        except VaultRefused as first:
            # The pinned version may have been retired by a deploy this instance has not
            # loaded yet (min_encryption_version raised): reload once, retry once.
            if not self.reload():
                raise TransitEncryptError(self._refusal(state, first)) from None
            state = self._state
            assert isinstance(state, _RemoteState)
            try:
                token = self._encrypt(state, payload)
            except VaultRefused as second:
                raise TransitEncryptError(self._refusal(state, second)) from None
        if self._observer is not None:
            self._observer.sealed(state.primary.hex(), token)
        return token

    def unseal(self, token: str) -> bytes:
        """Unseal a token minted for this audience under a verify or primary key of the loaded ring.

        Raises:
            InvalidRequestState: malformed, too long, unknown or retired kid, version mismatch,
                or refused by Vault (reason codes as in `AESGCMTokenCore`, plus ``version`` and
                ``vault refused``).
            BackendUnavailable: Vault unreachable or answering 5xx (remote mode).
        """
        state = self._state
        if isinstance(state, _DataKeyState):
            return state.core.unseal(token)
        try:
            raw_kid, body = unpack(TOKEN_PREFIX, token, min_body=VERSION_BYTES + MIN_VAULT_CIPHERTEXT_BYTES)
        except MalformedToken as exc:
            self._rejected(None, token, str(exc))
        entry = state.versions.get(raw_kid)
        if entry is None:
            self._rejected(raw_kid, token, "retired kid" if raw_kid in state.retired else "unknown kid")
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
        if self._observer is not None:
            self._observer.unsealed(kid, token)
        return payload

    def reload(self) -> bool:
        """Re-read the keystore; switch to a newer generation. Returns True if it switched.

        In datakey mode, keys not yet in memory are unwrapped (one Vault call each).

        Raises:
            KeystoreError, KeyRingError, AudienceError, ConfigError: the stored ring is unusable.
            BackendUnavailable, UnwrapError: a new data key cannot be unwrapped.
            The loaded ring stays in use whenever this raises.
        """
        ring = self._keystore.load()
        current = self._state.ring
        if ring.generation == current.generation and ring == current:
            return False
        if ring.codec != current.codec:
            raise ConfigError("the stored key ring now records another codec or transit key; restart to switch")
        state = self._build(ring)
        with self._lock:
            self._state = state
        return True

    # -- internals -------------------------------------------------------------------------

    def _build(self, ring: KeyRing) -> _RemoteState | _DataKeyState:
        ring.check_audience(self._audience)
        retired = frozenset(k.kid for k in ring.keys if k.state is KeyState.RETIRED)
        if self._params.mode == "datakey":
            keys = self._unwrap_all(ring)
            core = AESGCMTokenCore(
                keys, primary_kid=ring.primary.kid, audience=self._audience, retired=retired, observer=self._observer
            )
            return _DataKeyState(ring, core)
        versions = {kid_to_bytes(k.kid): (k.kid, key_version(k)) for k in ring.usable_keys()}
        return _RemoteState(
            ring=ring,
            primary=kid_to_bytes(ring.primary.kid),
            primary_version=key_version(ring.primary),
            versions=versions,
            retired=frozenset(kid_to_bytes(k) for k in retired),
        )

    def _unwrap_all(self, ring: KeyRing) -> dict[str, bytes]:
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
        self._unwrapped = cache  # only keys still usable stay in memory
        return keys

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

    def _encrypt(self, state: _RemoteState, payload: bytes) -> str:
        version = state.primary_version
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
        token = pack(TOKEN_PREFIX, state.primary, version.to_bytes(VERSION_BYTES, "big") + raw)
        if len(token) > MAX_TOKEN_CHARS:
            raise TransitEncryptError(f"payload too large: the token would exceed {MAX_TOKEN_CHARS} characters")
        return token

    def _refusal(self, state: _RemoteState, exc: VaultRefused) -> str:
        detail = "; ".join(exc.errors) or "no detail"
        return (
            f"Vault refused to encrypt with transit key {self._params.key!r} version {state.primary_version} "
            f"(HTTP {exc.status}: {detail}); check the ring's rotation state (mrtr-keys rotate status) and the policy"
        )

    def _rejected(self, raw_kid: bytes | None, token: str, reason: str) -> NoReturn:
        if self._observer is not None:
            self._observer.rejected(raw_kid.hex() if raw_kid is not None else None, token, reason)
        reject(reason)
