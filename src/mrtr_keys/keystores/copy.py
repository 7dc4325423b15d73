"""Copying a key ring from one keystore to another (``mrtr-keys keystore copy SRC DST``).

The copy is the same ring: same ``ring_id``, same generation, same keys, so instances reading
either keystore accept each other's tokens and a fleet can move from a file to Vault KV or
Secrets Manager (or publish a Kubernetes Secret from either) without a rotation. Into an empty
keystore it is a create; over an older generation of the same ring it is a compare-and-swap save.
It refuses to overwrite a newer or equal generation (a no-op when the two are identical) and a
different ring (another ``ring_id``): both would take keys away from running instances.
"""

from __future__ import annotations

from dataclasses import dataclass

from mrtr_keys.errors import ConflictError, KeyRingNotFound
from mrtr_keys.keystores import Keystore
from mrtr_keys.ring.model import KeyRing


@dataclass(frozen=True)
class CopyResult:
    """What `copy_ring` did: `changed` is False when the destination already held this very ring."""

    ring: KeyRing
    source: str
    destination: str
    changed: bool
    replaced_generation: int | None

    def describe(self) -> dict[str, object]:
        """Kids and states, generation and ring id (never material)."""
        return {
            "source": self.source,
            "destination": self.destination,
            "ring_id": self.ring.ring_id,
            "generation": self.ring.generation,
            "codec": self.ring.codec.type,
            "changed": self.changed,
            "replaced_generation": self.replaced_generation,
            "keys": [{"kid": k.kid, "state": k.state.value} for k in self.ring.keys],
        }


def copy_ring(source: Keystore, destination: Keystore) -> CopyResult:
    """Store the ring `source` holds in `destination`, keeping ``ring_id`` and generation.

    Raises:
        KeyRingNotFound, KeystoreError, KeyRingError: `source` has no usable ring.
        ConflictError: `destination` holds a newer (or equal but different) generation, or another ring.
        KeystoreError: `destination` cannot be written (read-only mount, permission denied).
    """
    ring = source.load()
    with destination.locked():
        try:
            current: KeyRing | None = destination.load()
        except KeyRingNotFound:
            current = None
        if current is None:
            destination.create(ring)
            return CopyResult(ring, source.url, destination.url, True, None)
        if current.ring_id != ring.ring_id:
            raise ConflictError(
                f"{destination.url} holds another key ring ({current.ring_id}, not {ring.ring_id}); "
                "nothing was copied (a different ring would take every key away from its instances)"
            )
        if current.generation >= ring.generation:
            if current == ring:
                return CopyResult(ring, source.url, destination.url, False, current.generation)
            raise ConflictError(
                f"{destination.url} holds generation {current.generation} of {ring.ring_id}, not older than "
                f"generation {ring.generation} at {source.url}; nothing was copied (copy the other way round?)"
            )
        destination.save(ring, expected_generation=current.generation)
        return CopyResult(ring, source.url, destination.url, True, current.generation)
