"""The one rule for moving a live codec to the ring a keystore holds now: library codecs and the sidecar alike.

`KeyRingCodec.reload` (`mrtr_keys.codecs.base`) and the sidecar's `RingState.reload`
(`mrtr_keys.service.reload`) both read the stored ring and ask `next_ring` what to do with it:

* ``unchanged``: it is the ring in use (equal in every field);
* ``refused``: it must not replace the ring in use (`reload_refusal`: a lower generation, the same
  generation with other content, or another ``ring_id``; or the process's codec pin refuses it,
  `mrtr_keys.codecs.pin`); a WARNING is logged once per distinct reason, and the caller keeps the
  reason for readiness;
* ``switch``: the caller builds its codec(s) for it, installs them in one assignment and reports the new
  generation (``ring_loaded`` on the codec's observer; the sidecar's audit sink).

A ring that cannot be read or built raises before any of this, and the loaded ring stays in use.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from mrtr_keys.codecs.pin import RingPin
from mrtr_keys.ring.model import KeyRing

UNCHANGED: Literal["unchanged"] = "unchanged"
REFUSED: Literal["refused"] = "refused"
SWITCH: Literal["switch"] = "switch"


@dataclass(frozen=True)
class NextRing:
    """What to do with a stored ring: `outcome`, and `refused` (the reason) when it is ``refused``."""

    outcome: Literal["unchanged", "refused", "switch"]
    refused: str | None = None


def reload_refusal(loaded: KeyRing, stored: KeyRing) -> str | None:
    """Why `stored` must not replace `loaded`, or None when it may.

    A reload only moves forward on the same ring: a lower generation (a keystore restored from
    a backup, a stale replica) would bring back keys a rotation retired, and another ``ring_id``
    is another ring altogether (a wrong path or URL). The generation is the ring's version: every
    change through `mrtr_keys.changes.apply` writes a higher one (the keystores' compare-and-swap
    refuses anything else), so the same generation with other content (keys, scope, TTL) is a ring
    edited or replaced behind the tools' back, and loading it would silently stop tokens of a
    replaced key from opening (issue 22). It is refused like a lower one.

    `loaded` and `stored` are assumed to differ (`next_ring` checks equality first).
    """
    if stored.ring_id != loaded.ring_id:
        return (
            f"the stored key ring is another ring (ring_id {stored.ring_id}, generation {stored.generation}) "
            f"than the loaded one (ring_id {loaded.ring_id}); still using generation {loaded.generation}: "
            "fix the keystore location, or restart to switch rings"
        )
    if stored.generation < loaded.generation:
        return (
            f"the stored key ring has generation {stored.generation}, older than the loaded generation "
            f"{loaded.generation} (restored from a backup?); still using generation {loaded.generation}. "
            "To put a backup back, write it as a new generation: mrtr-keys rotate restore FILE"
        )
    if stored.generation == loaded.generation:
        return (
            f"the stored key ring has generation {stored.generation} like the loaded one but other content "
            f"(edited or replaced outside mrtr-keys?); still using generation {loaded.generation}. Every change "
            "must write a new generation: put the intended ring back with mrtr-keys rotate restore FILE"
        )
    return None


def next_ring(
    loaded: KeyRing,
    stored: KeyRing,
    *,
    refused_before: str | None,
    log: logging.Logger,
    pin: RingPin | None = None,
) -> NextRing:
    """Decide whether `stored` replaces `loaded` (see the module docstring).

    Args:
        loaded: the ring in use.
        stored: the ring the keystore holds now.
        refused_before: the caller's last refusal, so the same one is logged only once.
        log: the caller's logger (``mrtr_keys.codecs`` or the sidecar's).
        pin: the process's codec pin (`mrtr_keys.codecs.pin.RingPin`); a ring it refuses is refused.
    """
    if stored == loaded:
        return NextRing(UNCHANGED)
    pinned = pin.refusal(stored) if pin is not None else None
    if pinned is not None:
        pinned = f"{pinned}; still using generation {loaded.generation}"
    refusal = pinned or reload_refusal(loaded, stored)
    if refusal is not None:
        if refusal != refused_before:
            log.warning("key ring not reloaded: %s", refusal)
        return NextRing(REFUSED, refusal)
    return NextRing(SWITCH)
