"""The shared token core of the data-key codecs: the ``mk1.`` and ``mk2.`` formats, one implementation.

The local, KMS-envelope and Vault data-key codecs all end here once they hold
32-byte ring keys in memory; they differ only in how those keys were obtained.
A key's format is fixed when it is made and recorded in the ring (`mrtr_keys.ring.model.KeyFormat`);
one core opens both formats, each token with the key its kid names, and seals in the primary's.

Token (see docs/token-format.md)::

    "mk1." + base64url(kid[4] || nonce[12] || ciphertext || tag[16])    AES-256-GCM
    "mk2." + base64url(kid[4] || nonce[12] || ciphertext || tag[16])    AES-256-GCM-SIV (RFC 8452)

* AES key per (ring key, audience): HKDF-SHA256 (RFC 5869), no salt, ``info`` =
  ``b"mrtr-keys/v1/aes-256-gcm/audience:" + audience`` (mk1) or
  ``b"mrtr-keys/v2/aes-256-gcm-siv/audience:" + audience`` (mk2), UTF-8. Derived once per key at
  construction, never per token, so a token sealed for audience A never unseals for B.
* Associated data: ``prefix || kid || audience`` (prefix and kid are fixed length),
  so the format version, the key slot and the audience are all under the tag.
* Nonce: 12 bytes from the OS CSPRNG (NIST SP 800-38D section 8.2.2, random
  construction), drawn in blocks to save a system call per token; the block is
  discarded in a forked child.
* Per-key limits at an attacker advantage of 2^-32: 2^32 seals for mk1 (NIST SP 800-38D section 8.3),
  2^48 for mk2 (RFC 8452 section 9, plaintexts up to 32 MiB); `mrtr_keys.ring.budgets`.
* The kid picks the key (never trial decryption); unknown, retired or revoked kids
  fail before any decryption, and a token whose prefix is not its key's format fails as ``other format``
  (so no token has two accepted spellings).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from cryptography import __version__ as cryptography_version
from cryptography.exceptions import InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESGCMSIV
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.codecs.usage import RingUsage
from mrtr_keys.errors import ConfigError, MrtrKeysError
from mrtr_keys.token import KID_BYTES, MAX_TOKEN_CHARS, MalformedToken, b64u_decode, b64u_encode, kid_to_bytes, unpack

if TYPE_CHECKING:
    from mrtr_keys.ring.model import KeyRing

TOKEN_PREFIX = "mk1."  # noqa: S105 - a format version, not a secret
"""Format version of ``mk1`` tokens (AES-256-GCM); differs from the MCP SDK's ``v1.``."""
MK2_PREFIX = "mk2."
"""Format version of ``mk2`` tokens (AES-256-GCM-SIV, RFC 8452)."""

AUDIENCE_KDF_INFO = b"mrtr-keys/v1/aes-256-gcm/audience:"
MK2_KDF_INFO = b"mrtr-keys/v2/aes-256-gcm-siv/audience:"
NONCE_BYTES = 12
TAG_BYTES = 16
MAX_PAYLOAD_BYTES = (MAX_TOKEN_CHARS - len(TOKEN_PREFIX)) * 3 // 4 - KID_BYTES - NONCE_BYTES - TAG_BYTES
"""Largest payload `seal` accepts (3,145,693 bytes): its token is exactly `MAX_TOKEN_CHARS` long,
so everything `seal` returns is something `unseal` will open."""
_PREFIX_LEN = len(TOKEN_PREFIX)
_PREFIXES = (TOKEN_PREFIX, MK2_PREFIX)
_NONCE_END = KID_BYTES + NONCE_BYTES
_MIN_RAW = KID_BYTES + NONCE_BYTES + TAG_BYTES
_NONCES_PER_BLOCK = 512
RETIRED_KID = "retired kid"
"""The reason code of a token whose kid the ring holds as retired (rotated out after its TTL)."""
REVOKED_KID = "revoked kid"
"""The reason code of a token whose kid the ring holds as revoked (`mrtr_keys.changes.revoke`): its own
audit reason and metric label, so an incident's refusals are told apart from a rotation's."""
_NONCE_BLOCK = NONCE_BYTES * _NONCES_PER_BLOCK


@dataclass(frozen=True)
class TokenFormat:
    """One format of this core: its name in the ring, token prefix, KDF info and AEAD (from `cryptography`)."""

    name: str
    prefix: str
    kdf_info: bytes
    aead: Callable[[bytes], AESGCM | AESGCMSIV]


MK1 = TokenFormat("mk1", TOKEN_PREFIX, AUDIENCE_KDF_INFO, AESGCM)
MK2 = TokenFormat("mk2", MK2_PREFIX, MK2_KDF_INFO, AESGCMSIV)
FORMATS = {MK1.name: MK1, MK2.name: MK2}
"""Formats by the name a ring records (`mrtr_keys.ring.model.KeyFormat`)."""


def derive_audience_key(ring_key: bytes, audience: str, info: bytes = AUDIENCE_KDF_INFO) -> bytes:
    """HKDF-SHA256(ring_key, info=info + audience) -> 32 bytes (RFC 5869); `info` is the format's
    (`AUDIENCE_KDF_INFO` for mk1, `MK2_KDF_INFO` for mk2)."""
    return HKDF(algorithm=SHA256(), length=32, salt=None, info=info + audience.encode("utf-8", "surrogatepass")).derive(
        ring_key
    )


def _aead(fmt: TokenFormat, key: bytes) -> AESGCM | AESGCMSIV:
    try:
        return fmt.aead(key)
    except UnsupportedAlgorithm:  # AES-GCM-SIV needs OpenSSL 3.2+ (every cryptography wheel since 42 has it)
        raise ConfigError(
            f"this cryptography build ({cryptography_version}) cannot do {fmt.name} (AES-256-GCM-SIV): install a "
            "cryptography wheel, >= 42, with its bundled OpenSSL"
        ) from None


def refused_kids(ring: KeyRing) -> tuple[frozenset[str], frozenset[str]]:
    """The kids `ring` knows that no longer open tokens: (retired, revoked)."""
    from mrtr_keys.ring.model import KeyState

    retired = frozenset(k.kid for k in ring.keys if k.state is KeyState.RETIRED)
    return retired, frozenset(k.kid for k in ring.keys if k.state is KeyState.REVOKED)


def reject(reason: str) -> NoReturn:
    """Fail closed: the one way a codec refuses a token (the reason is a short log-only code).

    Raises the MCP SDK's `InvalidRequestState` (imported here, not at module load: importing
    the `mcp` package costs ~1.5 s, which every `mrtr-keys rotate`/`init` run would pay).
    """
    from mcp.server.mcpserver import InvalidRequestState

    raise InvalidRequestState(reason)


def rejected(observer: CodecObserver | None, kid: bytes | str | None, token: object, reason: str) -> NoReturn:
    """The one way every codec refuses a token: tell `observer` (the kid as hex, from its 4 raw bytes
    or already as text; the token text, or ``""`` when the caller passed something that is not a
    `str`), then `reject` with `reason`."""
    if observer is not None:
        text = token if type(token) is str else ""
        observer.rejected(kid.hex() if isinstance(kid, bytes) else kid, text, reason)
    reject(reason)


class _NonceSource:
    """12-byte nonces from os.urandom, fetched in blocks of 512; fork-safe and thread-safe.

    A block is handed out by an `itertools.count` index: ``next()`` on it is one
    atomic C call under the GIL, so two threads never get the same slot without a
    lock per token. A forked child drops its parent's block (`os.register_at_fork`),
    so parent and child never share nonces. On a free-threaded interpreter (no GIL)
    every nonce is a fresh ``os.urandom(12)``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: tuple[bytes, Iterator[int]] = (b"", itertools.count(_NONCES_PER_BLOCK))
        gil = getattr(sys, "_is_gil_enabled", None)
        if gil is not None and not gil():
            self.take = _fresh_nonce  # type: ignore[method-assign]

    def reset(self) -> None:
        """Forget the current block (called in a forked child)."""
        self._state = (b"", itertools.count(_NONCES_PER_BLOCK))

    def take(self) -> bytes:
        block, index = self._state
        i = next(index)
        if i < _NONCES_PER_BLOCK:
            start = i * NONCE_BYTES
            return block[start : start + NONCE_BYTES]
        with self._lock:
            if self._state[1] is index:  # nobody refilled while we waited
                self._state = (os.urandom(_NONCE_BLOCK), itertools.count())
        return self.take()


def _fresh_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


_nonces = _NonceSource()
os.register_at_fork(after_in_child=_nonces.reset)
_take_nonce = _nonces.take

_AEADFn = Callable[[bytes, bytes, bytes | None], bytes]
"""A bound `encrypt` or `decrypt` of `AESGCM` / `AESGCMSIV`: (nonce, data, associated_data) -> bytes."""


class AESGCMTokenCore:
    """Seal and unseal ``mk1.`` and ``mk2.`` tokens for one audience with ring keys already in memory.

    Args:
        keys: kid (8 hex chars) -> 32-byte ring key, for every key that may unseal
            (states verify and primary). Bytes are copied; derivation happens here, once.
        primary_kid: the kid that seals; must be in `keys`.
        audience: bound into the key derivation and the associated data.
        retired: kids known to the ring but retired (only to give a clearer reason code).
        revoked: kids known to the ring but revoked (reason code `REVOKED_KID`).
        observer: optional hook called after every seal/unseal (audit); never sees plaintext.
        formats: kid -> format name (``mk1``, ``mk2``; `FORMATS`) for each of `keys`; absent: ``mk1``.
        usage: the ring's counts in this process (`mrtr_keys.codecs.usage.usage_for`): every seal, unseal and
            rejection counts on its kid's tally (a token whose kid the ring does not hold, on ``unknown``);
            None counts where nobody reads it.

    Raises:
        ValueError: a key is not 32 bytes, `primary_kid` is not among `keys`, or a format is unknown.
        ConfigError: this `cryptography` build cannot do a key's format.
    """

    __slots__ = ("_aad_tail", "_audience", "_mint", "_observer", "_refused", "_ring", "_sealer", "_tallies", "_unknown")

    def __init__(
        self,
        keys: Mapping[str, bytes],
        *,
        primary_kid: str,
        audience: str,
        retired: frozenset[str] = frozenset(),
        observer: CodecObserver | None = None,
        revoked: frozenset[str] = frozenset(),
        formats: Mapping[str, str] | None = None,
        usage: RingUsage | None = None,
    ) -> None:
        if primary_kid not in keys:
            raise ValueError("the primary kid must be among the unsealing keys")
        usage = usage if usage is not None else RingUsage("")
        # raw kid -> (bound decrypt, associated data, kid text, token prefix, unseal count); bound once
        self._ring: dict[bytes, tuple[_AEADFn, bytes, str, str, Callable[[], int]]] = {}
        encrypt_with: dict[bytes, _AEADFn] = {}
        self._audience = audience
        self._aad_tail = audience.encode("utf-8", "surrogatepass")
        for kid, key in keys.items():
            if len(key) != 32:
                raise ValueError(f"ring key {kid} must be 32 bytes")
            fmt = FORMATS.get((formats or {}).get(kid, MK1.name))
            if fmt is None:
                raise ValueError(f"ring key {kid}: this core seals only {', '.join(FORMATS)}")
            raw_kid = kid_to_bytes(kid)
            aad = fmt.prefix.encode("ascii") + raw_kid + self._aad_tail
            aead = _aead(fmt, derive_audience_key(bytes(key), audience, fmt.kdf_info))
            self._ring[raw_kid] = (aead.decrypt, aad, kid, fmt.prefix, usage.kid(kid).unseal)
            encrypt_with[raw_kid] = aead.encrypt
        self._mint = kid_to_bytes(primary_kid)
        _, aad, _, prefix, _ = self._ring[self._mint]
        tally = usage.kid(primary_kid)
        self._sealer = (encrypt_with[self._mint], aad, self._mint, primary_kid, prefix, tally.seal, tally)
        self._refused = {kid_to_bytes(k): RETIRED_KID for k in retired} | {
            kid_to_bytes(k): REVOKED_KID for k in revoked
        }
        self._tallies = {kid_to_bytes(k): usage.kid(k) for k in (*keys, *retired, *revoked)}
        self._unknown = usage.unknown
        self._observer = observer

    def __repr__(self) -> str:
        kids = ", ".join(f"{entry[2]} {entry[3][:-1]}" for entry in self._ring.values())
        return f"AESGCMTokenCore(audience={self._audience!r}, kids=[{kids}])"

    @property
    def primary_kid(self) -> str:
        return self._mint.hex()

    def seal(self, payload: bytes) -> str:
        """Encrypt `payload` under the primary key; returns a token of its format (``mk1.`` or ``mk2.``).

        Raises:
            MrtrKeysError: `payload` is longer than `MAX_PAYLOAD_BYTES` (its token would be
                over `MAX_TOKEN_CHARS`, which every codec refuses to unseal).
        """
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise MrtrKeysError(f"payload of {len(payload)} bytes is over the {MAX_PAYLOAD_BYTES}-byte token limit")
        encrypt, aad, raw_kid, kid, prefix, count, tally = self._sealer
        nonce = _take_nonce()
        token = prefix + b64u_encode(raw_kid + nonce + encrypt(nonce, payload, aad))
        if count() >= tally.mark:  # the reservation runs low: wake the reporter (`mrtr_keys.codecs.usage`)
            tally.wake()
        if self._observer is not None:
            self._observer.sealed(kid, token)
        return token

    def unseal(self, token: str) -> bytes:
        """Decrypt a token this core (or a peer with the same ring and audience) sealed.

        Raises:
            InvalidRequestState: reason ``too long``, ``malformed``, ``unknown kid``,
                ``retired kid``, ``revoked kid``, ``other format`` (its prefix is not its key's format) or
                ``seal`` (authentication failed).
        """
        # `token.unpack`, inlined on this hot path: type, cap, prefix, strict base64url, minimum length.
        if type(token) is not str:
            self._rejected(None, token, "malformed")
        if len(token) > MAX_TOKEN_CHARS:
            self._rejected(None, token, "too long")
        if not token.startswith(_PREFIXES):
            self._rejected(None, token, "malformed")
        try:
            raw = b64u_decode(token[_PREFIX_LEN:])
        except MalformedToken:
            self._rejected(None, token, "malformed")
        if len(raw) < _MIN_RAW:
            self._rejected(None, token, "malformed")
        raw_kid = raw[:KID_BYTES]
        entry = self._ring.get(raw_kid)
        if entry is None:
            self._rejected(raw_kid, token, self._refused.get(raw_kid, "unknown kid"))
        decrypt, aad, kid, prefix, count = entry
        if not token.startswith(prefix):
            self._rejected(raw_kid, token, "other format")
        try:
            payload = decrypt(raw[KID_BYTES:_NONCE_END], raw[_NONCE_END:], aad)
        except InvalidTag:
            self._rejected(raw_kid, token, "seal")
        count()
        if self._observer is not None:
            self._observer.unsealed(kid, token)
        return payload

    def _rejected(self, raw_kid: bytes | None, token: str, reason: str) -> NoReturn:
        self._tallies.get(raw_kid, self._unknown).reject()  # type: ignore[arg-type]
        rejected(self._observer, raw_kid, token, reason)


assert KID_BYTES == 4


def describe_token(ring: KeyRing | None, token: str) -> dict[str, Any]:
    """What `mrtr-keys inspect` says of an ``mk1.`` or ``mk2.`` token without decrypting it.

    Returns the format (``mk1``, ``mk2``), the kid, the kid's state in `ring` (``"unknown"`` when absent or
    `ring` is None) and its ``key_format`` there (None when unknown), the token's length in characters and its
    nonce, ciphertext and tag sizes in bytes.

    Raises:
        MalformedToken: the text does not parse as a token of either format.
    """
    prefix = next((p for p in _PREFIXES if isinstance(token, str) and token.startswith(p)), TOKEN_PREFIX)
    raw_kid, body = unpack(prefix, token, min_body=NONCE_BYTES + TAG_BYTES)
    kid = raw_kid.hex()
    key = ring.lookup(kid) if ring is not None else None
    return {
        "format": prefix.rstrip("."),
        "kid": kid,
        "state": key.state.value if key is not None else "unknown",
        "key_format": key.format.value if key is not None else None,
        "token_chars": len(token),
        "nonce_bytes": NONCE_BYTES,
        "ciphertext_bytes": len(body) - NONCE_BYTES - TAG_BYTES,
        "tag_bytes": TAG_BYTES,
    }
