"""Which release first reads each ring feature, so no change writes a ring a live instance would refuse.

The ring reader (`mrtr_keys.ring.document`) is strict: an instance that meets a key state, a key
format or a field it does not know refuses the whole ring and keeps serving on the one it had. A
change that would write such a ring must therefore first look at the fleet's presence rows (each
carries the instance's package version, `mrtr_keys.fleet.instances.InstanceRecord.version`) and
refuse while a live instance runs a release older than the feature's. `READS_SINCE` is the one table
of those releases; `can_read` is the one comparison.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mrtr_keys.ring.model import KeyRing

KEY_STATE_REVOKED = "key state revoked"
"""A key in state ``revoked`` (`mrtr_keys.changes.revoke`)."""
KEY_FORMAT_MK2 = "key format mk2"
"""A key in the ``mk2`` token format (AES-256-GCM-SIV, `mrtr_keys.codecs.aesgcm`)."""

READS_SINCE: dict[str, str] = {KEY_STATE_REVOKED: "0.2.0", KEY_FORMAT_MK2: "0.2.0"}
"""Ring feature -> the first release (PEP 440 ``X.Y.Z``) whose ring reader accepts it. A feature is
named for what the document holds, e.g. ``"key format mk2"`` or ``"key state revoked"``; each issue
that adds one registers it here with this release (`mrtr_keys.version.__version__`)."""

_RELEASE = re.compile(r"(\d+)\.(\d+)\.(\d+)")


def release(version: object) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a version string that starts with ``X.Y.Z`` (a local or
    pre-release suffix is ignored), else None (no version reported, or one we cannot read)."""
    if not isinstance(version, str):
        return None
    m = _RELEASE.match(version)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def can_read(version: object, feature: str) -> bool:
    """True when an instance reporting `version` reads rings holding `feature`.

    An instance with no version, or one that does not parse, is treated as too old (fail safe: the
    change waits or is forced, it never strands an instance on an old ring).

    Raises:
        KeyError: `feature` is not in `READS_SINCE` (a programming error, not user input).
    """
    need = release(READS_SINCE[feature])
    have = release(version)
    return have is not None and need is not None and have >= need


def features_of(ring: KeyRing) -> frozenset[str]:
    """The features of `READS_SINCE` that `ring` holds (what a reader must know to load it)."""
    from mrtr_keys.ring.model import KeyFormat, KeyState

    found: set[str] = set()
    if any(k.format is KeyFormat.MK2 for k in ring.keys):
        found.add(KEY_FORMAT_MK2)
    if any(k.state is KeyState.REVOKED for k in ring.keys):
        found.add(KEY_STATE_REVOKED)
    return frozenset(found)
