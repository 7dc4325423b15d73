"""The MCP SDK's own ``v1.`` tokens, minted and opened by the SDK's codec class with a ring's SDK keys.

A key ring adopted from ``RequestStateSecurity(keys=[KEY])`` (`mrtr-keys init --from-sdk-key-file`,
docs/migration.md) holds KEY as an ``sdk-v1`` key. Its tokens must stay exactly the SDK's, so instances
still on the SDK and instances on mrtr-keys read each other's rounds: `SDKTokenCore` hands the secrets
to the SDK's `AESGCMRequestStateCodec` (``mcp/server/request_state.py``: HKDF-SHA256 key, 4-byte kid,
``"v1." + base64url(kid || nonce || ciphertext+tag)``) and never restates its cryptography. It only
reads the kid from the token's framing first (the same framing as ours, `mrtr_keys.token`), for the
reason codes ``unknown kid`` / ``retired kid`` / ``revoked kid`` and the audit log.

Audience: the SDK's codec does not bind one; the SDK's boundary puts it in the envelope claim ``aud``
(``RequestStateBoundary._seal``) and checks it on the way in. So an SDK-format key seals and opens only
an SDK envelope (a JSON object) whose ``aud`` is this codec's audience: a token minted for another
audience under a shared SDK key is refused here too (reason ``audience``), as an ``mk1.`` token is by
its key derivation, and a sidecar client cannot mint one for an audience other than its own.

`build_core` picks the token core for a ring: the plain ``mk1.`` core when the ring holds no usable SDK
key (the hot path is unchanged), else `FormatDispatch`, which seals in the primary's format and opens
each token by its prefix.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from mrtr_keys.codecs.aesgcm import (
    MAX_PAYLOAD_BYTES,
    MK2_PREFIX,
    NONCE_BYTES,
    RETIRED_KID,
    REVOKED_KID,
    TAG_BYTES,
    AESGCMTokenCore,
    refused_kids,
    rejected,
)
from mrtr_keys.codecs.aesgcm import TOKEN_PREFIX as MK1_PREFIX
from mrtr_keys.codecs.observe import CodecObserver
from mrtr_keys.codecs.usage import RingUsage, usage_for
from mrtr_keys.errors import KeyRingError, MrtrKeysError
from mrtr_keys.ring.model import KeyFormat, KeyRing
from mrtr_keys.token import KID_BYTES, MalformedToken, b64u_decode, unpack

if TYPE_CHECKING:
    from mcp.server.request_state import AESGCMRequestStateCodec

SDK_PREFIX = "v1."
"""The MCP SDK's token prefix (``_TOKEN_PREFIX`` in request_state.py)."""


def _sdk_codec(secrets: list[bytes]) -> AESGCMRequestStateCodec:
    # Imported here: importing the `mcp` package costs ~1.5 s of CLI start-up.
    from mcp.server.request_state import AESGCMRequestStateCodec

    return AESGCMRequestStateCodec(secrets)


def sdk_kid(secret: bytes) -> str:
    """The kid (8 hex characters) the SDK's codec gives `secret`, read from a token it seals.

    Raises:
        ValueError: the SDK refuses the secret (shorter than 32 bytes).
    """
    token = _sdk_codec([secret]).seal(b"")
    return b64u_decode(token[len(SDK_PREFIX) :])[:KID_BYTES].hex()


def _audience_of(payload: bytes) -> object:
    """The ``aud`` claim of an SDK envelope, or None when `payload` is not a JSON object."""
    try:
        claims = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    return claims.get("aud") if isinstance(claims, dict) else None


class SDKTokenCore:
    """Seal and open the SDK's ``v1.`` tokens for one audience with a ring's usable SDK keys.

    Args:
        secrets: kid -> SDK secret for every usable ``sdk-v1`` key (maybe none: all retired); the kid must be
            the SDK's own.
        primary_kid: the kid that seals, or None when the ring's primary is not an SDK key.
        audience: the ``aud`` claim every envelope sealed or opened here must carry.
        known: every kid of the ring (to say ``retired kid`` or ``other format`` instead of ``unknown kid``).
        retired: the ring's retired kids. revoked: its revoked kids.
        usage: the ring's counts in this process, as `AESGCMTokenCore`'s.

    Raises:
        KeyRingError: a kid is not the one the SDK derives from its secret (an edited ring).
    """

    __slots__ = (
        "_audience",
        "_codec",
        "_kids",
        "_known",
        "_observer",
        "_primary",
        "_retired",
        "_revoked",
        "_sealing",
        "_usage",
    )

    def __init__(
        self,
        secrets: Mapping[str, bytes],
        *,
        primary_kid: str | None,
        audience: str,
        known: frozenset[str] = frozenset(),
        retired: frozenset[str] = frozenset(),
        observer: CodecObserver | None = None,
        revoked: frozenset[str] = frozenset(),
        usage: RingUsage | None = None,
    ) -> None:
        order = sorted(secrets, key=lambda kid: kid != primary_kid)  # the SDK seals with keys[0]
        for kid in order:
            if sdk_kid(secrets[kid]) != kid:
                raise KeyRingError(f"key {kid}: the kid is not the one the MCP SDK derives from its sdk_key")
        # None once every SDK key is retired: v1. tokens are then refused as "retired kid".
        self._codec = _sdk_codec([bytes(secrets[kid]) for kid in order]) if order else None
        self._kids = frozenset(order)
        self._primary = primary_kid
        self._audience = audience
        self._known, self._retired, self._revoked = known, retired, revoked
        self._observer = observer
        self._usage = usage if usage is not None else RingUsage("")
        self._sealing = self._usage.kid(primary_kid) if primary_kid is not None else None

    def __repr__(self) -> str:
        return f"SDKTokenCore(audience={self._audience!r}, kids=[{', '.join(sorted(self._kids))}])"

    def seal(self, payload: bytes) -> str:
        """The SDK's ``v1.`` token for `payload`, an SDK envelope whose ``aud`` is this audience.

        Raises:
            MrtrKeysError: no SDK key seals in this ring, the payload is over `MAX_PAYLOAD_BYTES`, or it is
                not an envelope for this audience.
        """
        if self._primary is None or self._codec is None:
            raise MrtrKeysError("this key ring's primary key is not an SDK key")
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise MrtrKeysError(f"payload of {len(payload)} bytes is over the {MAX_PAYLOAD_BYTES}-byte token limit")
        if _audience_of(payload) != self._audience:
            raise MrtrKeysError(
                "an SDK-format key seals only MCP SDK envelopes whose aud claim is this codec's audience"
            )
        token = self._codec.seal(payload)
        tally = self._sealing
        if tally is not None and tally.seal() >= tally.mark:
            tally.wake()
        if self._observer is not None:
            self._observer.sealed(self._primary, token)
        return token

    def unseal(self, token: str) -> bytes:
        """Open a ``v1.`` token sealed under a usable SDK key of the ring, for this audience.

        Raises:
            InvalidRequestState: reason ``too long``, ``malformed``, ``unknown kid``, ``retired kid``,
                ``other format`` (the kid is an ``mk1`` key), ``seal`` or ``audience``.
        """
        from mcp.server.request_state import InvalidRequestState

        kid = self.kid_of(token, SDK_PREFIX)
        if kid not in self._kids or self._codec is None:
            self.refuse(kid, token)
        try:
            payload = self._codec.unseal(token)
        except InvalidRequestState as exc:
            self._rejected(kid, token, "seal" if str(exc) == "seal" else "malformed")
        if _audience_of(payload) != self._audience:
            self._rejected(kid, token, "audience")
        self._usage.kid(kid).unseal()
        if self._observer is not None:
            self._observer.unsealed(kid, token)
        return payload

    def kid_of(self, token: object, prefix: str) -> str:
        """The kid of a `prefix` token from its framing alone; rejects ``too long`` / ``malformed``."""
        try:
            raw_kid, _ = unpack(prefix, token, min_body=NONCE_BYTES + TAG_BYTES)  # type: ignore[arg-type]
        except MalformedToken as exc:
            self._rejected(None, token, str(exc))
        return raw_kid.hex()

    def refuse(self, kid: str, token: str) -> NoReturn:
        """Reject a token whose kid no usable key of its format holds, saying why."""
        if kid in self._retired:
            self._rejected(kid, token, RETIRED_KID)
        if kid in self._revoked:
            self._rejected(kid, token, REVOKED_KID)
        self._rejected(kid, token, "other format" if kid in self._known else "unknown kid")

    def _rejected(self, kid: str | None, token: object, reason: str) -> NoReturn:
        usage = self._usage
        (usage.kid(kid) if kid is not None and kid in self._known else usage.unknown).reject()
        rejected(self._observer, kid, token, reason)


_MK_PREFIXES = (MK1_PREFIX, MK2_PREFIX)


class FormatDispatch:
    """A ring holding SDK keys and ours: seal in the primary's format, open each token by its prefix
    (``v1.`` by `SDKTokenCore`, ``mk1.`` and ``mk2.`` by `AESGCMTokenCore`)."""

    __slots__ = ("_mk1", "_sdk", "seal")

    def __init__(self, sdk: SDKTokenCore, mk1: AESGCMTokenCore | None, *, seal: Callable[[bytes], str]) -> None:
        self._sdk, self._mk1 = sdk, mk1
        self.seal = seal

    def __repr__(self) -> str:
        return f"FormatDispatch({self._sdk!r}, {self._mk1!r})"

    def unseal(self, token: str) -> bytes:
        """See `SDKTokenCore.unseal` and `AESGCMTokenCore.unseal`; every failure is `InvalidRequestState`."""
        if type(token) is str and token.startswith(_MK_PREFIXES):
            if self._mk1 is not None:
                return self._mk1.unseal(token)
            self._sdk.refuse(self._sdk.kid_of(token, token[: len(MK1_PREFIX)]), token)
        return self._sdk.unseal(token)


def build_core(
    ring: KeyRing, keys: Mapping[str, bytes], *, audience: str, observer: CodecObserver | None = None
) -> AESGCMTokenCore | FormatDispatch:
    """The token core for `ring`: `AESGCMTokenCore` over `keys` (kid -> 32-byte ring key, each in the format
    the ring records for it, ``mk1`` or ``mk2``) when no key is an SDK key, else a `FormatDispatch` over both
    kinds (also once the SDK keys are retired, so a ``v1.`` token is then refused as ``retired kid``, not
    ``malformed``). Either counts into the ring's `mrtr_keys.codecs.usage.RingUsage` of this process.

    Raises:
        ValueError: a ring key is not 32 bytes. KeyRingError: an SDK key's kid is not its own.
    """
    retired, revoked = refused_kids(ring)
    primary = ring.primary
    usage = usage_for(ring.ring_id)
    formats = {k.kid: k.format.value for k in ring.keys if k.format is not KeyFormat.SDK_V1}
    sdk = {k.kid: k.material for k in ring.usable_keys() if k.format is KeyFormat.SDK_V1 and k.material is not None}
    if not any(k.format is KeyFormat.SDK_V1 for k in ring.keys):
        return AESGCMTokenCore(
            keys,
            primary_kid=primary.kid,
            audience=audience,
            retired=retired,
            revoked=revoked,
            observer=observer,
            formats=formats,
            usage=usage,
        )
    sdk_primary = primary.kid if primary.format is KeyFormat.SDK_V1 else None
    known = frozenset(k.kid for k in ring.keys)
    sdk_core = SDKTokenCore(
        sdk,
        primary_kid=sdk_primary,
        audience=audience,
        known=known,
        retired=retired,
        revoked=revoked,
        observer=observer,
        usage=usage,
    )
    mk1_keys = {kid: key for kid, key in keys.items() if kid not in sdk}
    mk1_core: AESGCMTokenCore | None = None
    if mk1_keys:
        # The mk1 core needs a sealing kid; while an SDK key is primary its `seal` is never called.
        mk1_primary = primary.kid if sdk_primary is None else next(iter(mk1_keys))
        mk1_core = AESGCMTokenCore(
            mk1_keys,
            primary_kid=mk1_primary,
            audience=audience,
            retired=retired,
            revoked=revoked,
            observer=observer,
            formats=formats,
            usage=usage,
        )
    if sdk_primary is not None:
        seal = sdk_core.seal
    else:
        assert mk1_core is not None  # the primary is an mk1 key, so it is among `keys`
        seal = mk1_core.seal
    return FormatDispatch(sdk_core, mk1_core, seal=seal)


def describe_sdk_token(ring: KeyRing | None, token: str) -> dict[str, Any]:
    """What `mrtr-keys inspect` says of the MCP SDK's ``v1.`` token without decrypting it: format ``v1``,
    the SDK kid, that kid's state in `ring` (``"unknown"`` when absent), ``key_format`` ``sdk-v1`` and
    the sizes (characters; bytes for nonce, ciphertext and tag).

    Raises:
        MalformedToken: the text does not parse as a ``v1.`` token.
    """
    raw_kid, body = unpack(SDK_PREFIX, token, min_body=NONCE_BYTES + TAG_BYTES)
    kid = raw_kid.hex()
    key = ring.lookup(kid) if ring is not None else None
    return {
        "format": SDK_PREFIX.rstrip("."),
        "kid": kid,
        "state": key.state.value if key is not None else "unknown",
        "key_format": KeyFormat.SDK_V1.value,
        "token_chars": len(token),
        "nonce_bytes": NONCE_BYTES,
        "ciphertext_bytes": len(body) - NONCE_BYTES - TAG_BYTES,
        "tag_bytes": TAG_BYTES,
    }
