"""A key ring's audience scope: which audiences it may seal and unseal for.

An empty scope allows any audience. Names are matched exactly and
case-sensitively (``billing`` never matches ``Billing`` or ``billing-admin``).
Codecs check the scope at construction (`KeyRing.check_audience`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from mrtr_keys.changes.apply import ChangeListener, ChangeResult, apply_change
from mrtr_keys.errors import ConfigError
from mrtr_keys.keystores import Keystore
from mrtr_keys.ring.model import KeyRing

MAX_AUDIENCE_CHARS = 256


def check_name(name: str) -> str:
    """Return `name` if it is a usable audience (non-empty, printable, no surrounding space, <= 256 chars)."""
    if not name or name != name.strip() or not name.isprintable() or len(name) > MAX_AUDIENCE_CHARS:
        raise ConfigError(f"an audience is 1-{MAX_AUDIENCE_CHARS} printable characters without surrounding spaces")
    return name


def add(
    keystore: Keystore, name: str, *, now: datetime | None = None, listeners: Sequence[ChangeListener] = ()
) -> ChangeResult:
    """Add `name` to the scope (no-op if present); `listeners` as for `mrtr_keys.changes.apply.apply_change`."""
    check_name(name)

    def transform(ring: KeyRing, at: datetime) -> ChangeResult:
        if name in ring.audiences:
            return ChangeResult("audience", False, ring, f"audience {name!r} is already in scope")
        after = ring.next_generation(audiences=(*ring.audiences, name))
        return ChangeResult("audience", True, after, f"audience {name!r} added", details={"added": name})

    return apply_change(keystore, "audience", transform, now=now, listeners=listeners)


def remove(
    keystore: Keystore,
    name: str,
    *,
    allow_any: bool = False,
    now: datetime | None = None,
    listeners: Sequence[ChangeListener] = (),
) -> ChangeResult:
    """Remove `name` from the scope (no-op if absent); `listeners` as for `mrtr_keys.changes.apply.apply_change`.

    Removing the last audience would leave the scope empty, which allows ANY audience: a
    revocation that widens access. That needs `allow_any=True` (``--allow-any``).

    Raises:
        ConfigError: `name` is the last audience and `allow_any` is False.
    """

    def transform(ring: KeyRing, at: datetime) -> ChangeResult:
        if name not in ring.audiences:
            return ChangeResult("audience", False, ring, f"audience {name!r} is not in scope")
        if ring.audiences == (name,) and not allow_any:
            raise ConfigError(
                f"{name!r} is the last audience in scope; removing it would allow ANY audience. "
                "Add the audience that should remain first, or pass --allow-any to open the scope"
            )
        after = ring.next_generation(audiences=tuple(a for a in ring.audiences if a != name))
        msg = f"audience {name!r} removed"
        if not after.audiences:
            msg += "; the scope is now empty, which allows any audience"
        return ChangeResult("audience", True, after, msg, details={"removed": name})

    return apply_change(keystore, "audience", transform, now=now, listeners=listeners)
