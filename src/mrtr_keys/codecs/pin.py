"""The codec pin: which rings a process accepts, decided by its own settings and not by the ring.

A ring records its own codec (``{"type": "kms", "kms_key_id": ARN}``), and the backend that opens it is
chosen from that record (`mrtr_keys.backends.backend_for`). So whoever can write the keystore, without any
access to KMS or Vault, could replace a KMS ring by a ``local`` ring of keys they chose, keeping its
``ring_id`` and raising its generation: an instance would load it at start or on reload and then accept
tokens forged with those keys (issue 39). A process that knows what its rings must be says so, and every
ring it meets is held to that:

* ``expect_codec=`` / ``MRTR_KEYS_EXPECT_CODEC`` (``local``, ``kms`` or ``vault-transit``): only rings
  of that codec type;
* ``kms_key_id=`` / ``MRTR_KEYS_KMS_KEY_ID`` (docs/kms.md): only KMS rings wrapped under that key (it
  implies ``expect_codec="kms"``).

At start a refused ring is a `ConfigError` (one line, exit 2 from the CLI); on reload it is refused like
an older generation (`mrtr_keys.codecs.generations.next_ring`): the last good ring stays in use and the
reason shows in ``reload_refused`` / the sidecar's ``/readyz`` and the presence heartbeat.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from mrtr_keys.errors import ConfigError
from mrtr_keys.providers.kms.client import ENV_KMS_KEY_ID
from mrtr_keys.providers.kms.wrapped import key_arn_matches
from mrtr_keys.ring.model import CODEC_TYPES, KeyRing

ENV_EXPECT_CODEC = "MRTR_KEYS_EXPECT_CODEC"
"""The only codec type (``local``, ``kms``, ``vault-transit``) whose rings this process accepts."""


@dataclass(frozen=True, slots=True)
class RingPin:
    """What a ring must be for this process to load it (None: anything).

    `codec` is a codec type; `kms_key_id` a KMS key ARN or bare key id (then `codec` is ``kms``) and
    `source` what set the pin, for messages (the setting's name, never its value's secret: there is none).
    """

    codec: str | None = None
    kms_key_id: str | None = None
    source: str = ""

    @classmethod
    def from_settings(
        cls,
        expect_codec: str | None = None,
        kms_key_id: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> RingPin:
        """The pin from arguments, else ``MRTR_KEYS_EXPECT_CODEC`` and ``MRTR_KEYS_KMS_KEY_ID``.

        Raises:
            ConfigError: an unknown codec type, or a KMS key pin with another expected codec.
        """
        env = os.environ if environ is None else environ
        codec_from = "expect_codec" if expect_codec else ENV_EXPECT_CODEC
        key_from = "kms_key_id" if kms_key_id else ENV_KMS_KEY_ID
        codec = expect_codec or env.get(ENV_EXPECT_CODEC) or None
        key = kms_key_id or env.get(ENV_KMS_KEY_ID) or None
        if codec is not None and codec not in CODEC_TYPES:
            raise ConfigError(f"{codec_from} {codec!r} is not a codec type (one of: {', '.join(sorted(CODEC_TYPES))})")
        if key is not None:
            if codec not in (None, "kms"):
                raise ConfigError(f"{key_from} pins a KMS key, but {codec_from} expects {codec!r} rings")
            return cls("kms", key, key_from)
        return cls(codec, None, codec_from if codec else "")

    def __bool__(self) -> bool:
        return self.codec is not None

    def refusal(self, ring: KeyRing) -> str | None:
        """Why this process must not load `ring`, or None when it may (one line, no key material)."""
        if self.codec is not None and ring.codec.type != self.codec:
            return (
                f"key ring {ring.ring_id} generation {ring.generation} is a {ring.codec.type!r} ring, but "
                f"{self.source} lets this process load only {self.codec!r} rings (was the keystore "
                "rewritten by someone who cannot use the expected keys?)"
            )
        if self.kms_key_id is not None:
            recorded = ring.codec.params.get("kms_key_id")
            if not isinstance(recorded, str) or not key_arn_matches(self.kms_key_id, recorded):
                return (
                    f"key ring {ring.ring_id} generation {ring.generation} is wrapped under KMS key "
                    f"{recorded or 'none'}, but {self.source} lets this process load only rings wrapped under "
                    f"{self.kms_key_id}"
                )
        return None

    def check(self, ring: KeyRing) -> None:
        """Raise `ConfigError` with `refusal` when `ring` is refused."""
        reason = self.refusal(ring)
        if reason is not None:
            raise ConfigError(f"refused: {reason}")


NO_PIN = RingPin()
