"""The key ring: an immutable, versioned set of keys with exactly one primary.

A `KeyRing` is the document every instance of a fleet shares. It owns the keys
and their invariants; codecs (the primitives, as in Tink's key-set handle vs
AEAD split) are built from it and never change it. Changes are made by
`mrtr_keys.changes.rotation` and `mrtr_keys.changes.scope`, which return new rings with a
generation one higher; keystores persist them with compare-and-swap on the
generation. `mrtr_keys.ring.document` reads the document below into a `KeyRing`.

Document (JSON, ``format`` = ``mrtr-keys.keyring``, ``version`` = 1)::

    {"format": "mrtr-keys.keyring", "version": 1,
     "ring_id": "r-<16 hex>", "generation": 3, "ttl_seconds": 600.0,
     "audiences": ["billing"], "codec": {"type": "local"},
     "created_at": "2026-11-29T23:00:00Z",
     "keys": [{"kid": "1a2b3c4d", "state": "primary",
               "created_at": "...", "promoted_at": "...", "demoted_at": null,
               "retired_at": null, "material": "<base64 of 32 bytes>"}]}

Key states (the three rotation phases of the MCP SDK docs): ``verify`` (unseals
only), ``primary`` (seals and unseals; exactly one), ``retired`` (neither). A destroyed key
(`mrtr_keys.changes.lifecycle`) stays ``retired``, with ``destroyed_at`` and no material; a TTL
lowering not yet in force waits in ``ttl_lowering`` (``{"ttl_seconds", "requested_at"}``).
``revoked`` (neither, for good: `mrtr_keys.changes.revoke`, a leaked key) carries ``revoked_at``,
``revoked_reason`` and ``revoked_by``, and usually ``destroyed_at`` (its material removed at once);
codecs refuse its tokens with the reason ``revoked kid``. Releases before 0.2.0 do not read it
(`mrtr_keys.ring.compat`).
``material`` is present for the local codec; codecs whose keys live elsewhere
(KMS, Vault) keep their per-key fields in ``key_data`` instead (wrapped key,
KMS key id, encryption context, transit key version).

``format`` (absent = ``mk1``), fixed when the key is made: ``mk2`` keys seal AES-256-GCM-SIV tokens
(`mrtr_keys.codecs.aesgcm`, docs/token-format.md; releases before 0.2.0 do not read them,
`mrtr_keys.ring.compat`); ``sdk-v1`` keys hold an MCP SDK secret as ``sdk_key`` and seal the SDK's
``v1.`` tokens (`mrtr_keys.ring.sdk_keys`, docs/migration.md).

Seal budgets (`mrtr_keys.ring.budgets`): a key's ``budget`` (absent: the ring's ``seal_budget``, absent:
its format's default) is how many seals it may make before it is due for rotation; older readers
ignore both fields.
"""

from __future__ import annotations

import base64
import json
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from mrtr_keys.errors import AudienceError, ConfigError, KeyRingError
from mrtr_keys.ring.sdk_keys import MAX_SDK_KEY_BYTES, MIN_SDK_KEY_BYTES

FORMAT = "mrtr-keys.keyring"
VERSION = 1
KEY_BYTES = 32
DEFAULT_TTL_SECONDS = 600.0
"""The MCP SDK's default `RequestStateSecurity(ttl=...)`, in seconds."""
MAX_TTL_SECONDS = 30 * 24 * 3600.0
"""Longest TTL a ring accepts (30 days): a round that waits longer is better restarted, and the
retire gate (promote + TTL + 60 s) must stay a date that can be computed and printed."""
MAX_GENERATION = 2**53 - 1
"""Largest generation (the largest integer every JSON reader and a PostgreSQL bigint agree on)."""
MAX_BUDGET = 2**53 - 1
"""Largest seal budget a ring records (the largest integer every JSON reader keeps exactly)."""


class KeyFormat(StrEnum):
    """Which token format a key seals and opens (see the module docstring)."""

    MK1 = "mk1"
    MK2 = "mk2"
    SDK_V1 = "sdk-v1"


class KeyState(StrEnum):
    """Lifecycle state of one key."""

    VERIFY = "verify"
    PRIMARY = "primary"
    RETIRED = "retired"
    REVOKED = "revoked"


MAX_REVOKED_REASON = 500
"""Longest ``revoked_reason`` (characters): a sentence for the incident record, not a report."""


def check_ttl(ttl: object) -> float:
    """`ttl` as float seconds if it is a usable ring TTL (finite, > 0, <= `MAX_TTL_SECONDS`).

    Raises:
        ConfigError: anything else, in one line naming ``--ttl``.
    """

    if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not (0 < ttl <= MAX_TTL_SECONDS):
        raise ConfigError(f"--ttl must be a number of seconds above 0 and at most {MAX_TTL_SECONDS:g} (30 days)")
    return float(ttl)


def server_ttl_too_long(ttl: float, limit: float) -> str:
    """The one refusal of a server ``ttl`` above the ring's (`KeyRing.server_ttl_limit`), library codec and
    sidecar client alike, with the one command that fixes it (``keys ttl``: raising is at once, no rotation)."""
    return (
        f"ttl {ttl:g} s is longer than the key ring's TTL ({limit:g} s), so a retire could reject rounds still in "
        "flight; raise the ring's TTL (at once, no rotation) with: mrtr-keys keys ttl SECONDS"
    )


def utcnow() -> datetime:
    """The current time, timezone-aware UTC, whole microseconds."""
    return datetime.now(UTC)


def format_time(t: datetime | None) -> str | None:
    """ISO 8601 UTC with a ``Z`` suffix, or None."""
    if t is None:
        return None
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


def parse_time(value: object, what: str) -> datetime | None:
    """Parse an ISO 8601 time written by `format_time`; None stays None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise KeyRingError(f"{what} must be an ISO 8601 UTC time string")
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise KeyRingError(f"{what} is not an ISO 8601 time") from None
    if t.tzinfo is None:
        raise KeyRingError(f"{what} has no timezone; times are UTC")
    return t.astimezone(UTC)


def new_kid(taken: Iterable[str] = ()) -> str:
    """A fresh random kid (8 lowercase hex characters) not in `taken`."""
    used = set(taken)
    while True:
        kid = secrets.token_hex(4)
        if kid not in used:
            return kid


def new_ring_id() -> str:
    """A fresh random ring id (``r-`` and 16 hex characters); not secret."""
    return "r-" + secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class Key:
    """One key of a ring. `material` and `key_data` never appear in `repr()`."""

    kid: str
    state: KeyState
    created_at: datetime
    promoted_at: datetime | None = None
    demoted_at: datetime | None = None
    retired_at: datetime | None = None
    material: bytes | None = field(default=None, repr=False)
    destroyed_at: datetime | None = None
    key_data: Mapping[str, Any] = field(default_factory=dict, repr=False)
    format: KeyFormat = KeyFormat.MK1
    revoked_at: datetime | None = None
    revoked_reason: str | None = None
    revoked_by: str | None = None
    budget: int | None = None
    """Seals this key may make before it is due for rotation; None: the ring's `KeyRing.seal_budget`,
    else its format's default (`mrtr_keys.ring.budgets.budget_of`)."""

    @property
    def usable(self) -> bool:
        """True if tokens under this key may be unsealed (state verify or primary)."""
        return self.state is KeyState.VERIFY or self.state is KeyState.PRIMARY

    @property
    def revoked(self) -> bool:
        """True once the key was revoked (`mrtr_keys.changes.revoke`): final, never usable again."""
        return self.state is KeyState.REVOKED

    @property
    def destroyed(self) -> bool:
        """True once the key's material was destroyed (the key is then retired for good)."""
        return self.destroyed_at is not None

    def describe(self) -> dict[str, Any]:
        """Public fields only (no material, no wrapped key): kid, state and times (``destroyed_at`` only for
        a destroyed key and the ``revoked_*`` fields only for a revoked one, so older readers see the same
        document)."""
        out: dict[str, Any] = {
            "kid": self.kid,
            "state": self.state.value,
            "created_at": format_time(self.created_at),
            "promoted_at": format_time(self.promoted_at),
            "demoted_at": format_time(self.demoted_at),
            "retired_at": format_time(self.retired_at),
            "format": self.format.value,
        }
        if self.destroyed_at is not None:
            out["destroyed_at"] = format_time(self.destroyed_at)
        if self.state is KeyState.REVOKED:
            out["revoked_at"] = format_time(self.revoked_at)
            out["revoked_reason"] = self.revoked_reason
            out["revoked_by"] = self.revoked_by
        if self.budget is not None:
            out["budget"] = self.budget
        return out


CODEC_TYPES = frozenset({"local", "kms", "vault-transit"})
"""The codec types a ring may record (each has its backend, `mrtr_keys.backends`)."""


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """Which codec a ring is for (``local``, ``kms``, ``vault-transit``) and its non-secret settings."""

    type: str = "local"
    params: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, **dict(self.params)}


@dataclass(frozen=True, slots=True)
class TtlLowering:
    """A requested lower TTL (seconds) that is not in force yet, and when it was requested."""

    ttl_seconds: float
    requested_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {"ttl_seconds": self.ttl_seconds, "requested_at": format_time(self.requested_at)}


@dataclass(frozen=True, slots=True)
class KeyRing:
    """An immutable key ring; every constructor path validates its invariants."""

    ring_id: str
    generation: int
    keys: tuple[Key, ...]
    audiences: tuple[str, ...] = ()
    ttl_seconds: float = DEFAULT_TTL_SECONDS
    codec: CodecSpec = field(default_factory=CodecSpec)
    created_at: datetime = field(default_factory=utcnow)
    ttl_lowering: TtlLowering | None = None
    seal_budget: int | None = None
    """The seal budget of every key without one of its own, the keys made later included (``mrtr-keys keys
    budget SEALS``); None: each key's format default (`mrtr_keys.ring.budgets`)."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def server_ttl_limit(self) -> float:
        """The longest ``ttl`` an MCP server may start with: the TTL, or a pending lower one."""
        if self.ttl_lowering is not None:
            return min(self.ttl_seconds, self.ttl_lowering.ttl_seconds)
        return self.ttl_seconds

    @property
    def primary(self) -> Key:
        """The one key that seals."""
        return next(k for k in self.keys if k.state is KeyState.PRIMARY)

    def lookup(self, kid: str) -> Key | None:
        """The key with this kid, whatever its state, or None."""
        for k in self.keys:
            if k.kid == kid:
                return k
        return None

    def usable_keys(self) -> tuple[Key, ...]:
        """Keys that unseal (verify and primary), primary first."""
        return tuple(sorted((k for k in self.keys if k.usable), key=lambda k: k.state is not KeyState.PRIMARY))

    def allows_audience(self, audience: str) -> bool:
        """Exact, case-sensitive membership; an empty scope allows any audience."""
        return not self.audiences or audience in self.audiences

    def check_audience(self, audience: str) -> None:
        """Raise `AudienceError` unless the ring's scope allows `audience` (exact, case-sensitive)."""
        if not isinstance(audience, str) or not audience:
            raise AudienceError("an audience is a non-empty string (the MCP server's name or its audience=)")
        if not self.allows_audience(audience):
            scope = ", ".join(self.audiences)
            raise AudienceError(
                f"audience {audience!r} is outside this key ring's scope ({scope}); "
                f"add it with: mrtr-keys audience add {audience}"
            )

    def next_generation(self, **changes: Any) -> KeyRing:
        """A copy with `changes` applied and the generation one higher (validated)."""
        return replace(self, generation=self.generation + 1, **changes)

    def to_json(self) -> dict[str, Any]:
        """The document, including key material (for keystores only; never print it)."""
        keys = []
        for k in self.keys:
            entry = k.describe()
            if k.format is KeyFormat.MK1:
                del entry["format"]  # the default: an mk1 key's entry is what it was before formats existed
            if k.material is not None:
                field_name = "sdk_key" if k.format is KeyFormat.SDK_V1 else "material"
                entry[field_name] = base64.b64encode(k.material).decode("ascii")
            if k.key_data:
                entry["key_data"] = dict(k.key_data)
            keys.append(entry)
        return {
            "format": FORMAT,
            "version": VERSION,
            "ring_id": self.ring_id,
            "generation": self.generation,
            "ttl_seconds": self.ttl_seconds,
            "audiences": list(self.audiences),
            "codec": self.codec.to_json(),
            "created_at": format_time(self.created_at),
            **({"ttl_lowering": self.ttl_lowering.to_json()} if self.ttl_lowering is not None else {}),
            **({"seal_budget": self.seal_budget} if self.seal_budget is not None else {}),
            "keys": keys,
        }

    def dumps(self) -> bytes:
        """The JSON document as bytes (indented, stable key order)."""
        return (json.dumps(self.to_json(), indent=2) + "\n").encode("utf-8")

    def describe(self) -> dict[str, Any]:
        """Everything but key material and wrapped keys: safe to print and serve."""
        return {
            "ring_id": self.ring_id,
            "generation": self.generation,
            "ttl_seconds": self.ttl_seconds,
            "audiences": list(self.audiences),
            "codec": self.codec.type,
            **({"ttl_lowering": self.ttl_lowering.to_json()} if self.ttl_lowering is not None else {}),
            **({"seal_budget": self.seal_budget} if self.seal_budget is not None else {}),
            "keys": [k.describe() for k in self.keys],
        }


def _validate(ring: KeyRing) -> None:
    if not ring.ring_id or not ring.ring_id.isascii() or len(ring.ring_id) > 64:
        raise KeyRingError("ring_id must be 1-64 ASCII characters")
    if not 1 <= ring.generation <= MAX_GENERATION:
        raise KeyRingError(f"generation must be between 1 and {MAX_GENERATION}")
    if not (math.isfinite(ring.ttl_seconds) and 0 < ring.ttl_seconds <= MAX_TTL_SECONDS):
        raise KeyRingError(f"ttl_seconds must be a number of seconds above 0 and at most {MAX_TTL_SECONDS:g}")
    seen: set[str] = set()
    for k in ring.keys:
        if k.kid in seen:
            raise KeyRingError(f"duplicate kid {k.kid}")
        seen.add(k.kid)
        if k.format is KeyFormat.SDK_V1:
            if ring.codec.type != "local" or (k.material is None and k.destroyed_at is None):
                raise KeyRingError(f"key {k.kid}: an sdk-v1 key lives only in a local ring, with its secret")
            if k.material is not None and not MIN_SDK_KEY_BYTES <= len(k.material) <= MAX_SDK_KEY_BYTES:
                raise KeyRingError(f"key {k.kid}: an SDK key is {MIN_SDK_KEY_BYTES} to {MAX_SDK_KEY_BYTES} bytes")
        elif k.material is not None and len(k.material) != KEY_BYTES:
            raise KeyRingError(f"key {k.kid}: material must be {KEY_BYTES} bytes")
        if k.destroyed_at is not None and (not _ended(k) or k.material is not None or k.key_data):
            raise KeyRingError(f"key {k.kid}: a destroyed key is retired or revoked and has no material or key_data")
        _validate_revocation(k)
        if not _budget_ok(k.budget):
            raise KeyRingError(f"key {k.kid}: budget must be a whole number of seals from 1 to {MAX_BUDGET}")
    primaries = [k.kid for k in ring.keys if k.state is KeyState.PRIMARY]
    if not primaries:
        raise KeyRingError("key ring has no primary key (exactly one is required)")
    if len(primaries) > 1:
        raise KeyRingError(
            f"key ring has {len(primaries)} primary keys ({', '.join(primaries)}); exactly one is allowed"
        )
    if not _budget_ok(ring.seal_budget):
        raise KeyRingError(f"seal_budget must be a whole number of seals from 1 to {MAX_BUDGET}")
    low = ring.ttl_lowering
    if low is not None and not (math.isfinite(low.ttl_seconds) and 0 < low.ttl_seconds < ring.ttl_seconds):
        raise KeyRingError("ttl_lowering.ttl_seconds must be above 0 and below ttl_seconds")
    if len(set(ring.audiences)) != len(ring.audiences):
        raise KeyRingError("audiences contain a duplicate")
    for a in ring.audiences:
        if not a:
            raise KeyRingError("an audience is a non-empty string")


def _budget_ok(budget: object) -> bool:
    """None, or an int (not a bool) from 1 to `MAX_BUDGET`."""
    return budget is None or (type(budget) is int and 1 <= budget <= MAX_BUDGET)


def _ended(key: Key) -> bool:
    return key.state is KeyState.RETIRED or key.state is KeyState.REVOKED


def _validate_revocation(k: Key) -> None:
    """A revoked key has its time, reason and author; any other key has none of them."""
    fields = (k.revoked_at, k.revoked_reason, k.revoked_by)
    if k.state is not KeyState.REVOKED:
        if any(f is not None for f in fields):
            raise KeyRingError(f"key {k.kid}: revoked_at, revoked_reason and revoked_by belong to a revoked key")
        return
    if k.revoked_at is None:
        raise KeyRingError(f"key {k.kid}: a revoked key needs revoked_at (when it was revoked, UTC)")
    for name, value in (("revoked_reason", k.revoked_reason), ("revoked_by", k.revoked_by)):
        if not isinstance(value, str) or not value.strip() or len(value) > MAX_REVOKED_REASON:
            raise KeyRingError(f"key {k.kid}: {name} must be text of 1 to {MAX_REVOKED_REASON} characters")
