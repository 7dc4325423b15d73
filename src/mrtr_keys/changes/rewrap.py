"""Re-wrapping a KMS ring's data keys under another KMS key (`mrtr-keys rewrap --kms-key-id ARN`).

Each usable data key (verify and primary) is re-encrypted with KMS ``ReEncrypt`` from the
ring's current KMS key to the new one, with the same encryption context; the plaintext
never leaves KMS (AWS KMS API reference, ReEncrypt). Kids and data keys are unchanged, so
every token in flight keeps unsealing. The change is one generation saved with the
keystore's compare-and-swap (`mrtr_keys.changes.apply.apply_change`); if any call fails, nothing
is saved and the ring stays wrapped under the old key. Re-running it is a no-op.

Retired keys are left as they are: they are never unwrapped again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from mrtr_keys.changes.apply import ChangeListener, ChangeResult, apply_change
from mrtr_keys.errors import ConfigError
from mrtr_keys.keystores import Keystore
from mrtr_keys.providers.kms.service import KMSService
from mrtr_keys.providers.kms.wrapped import checked_wrapped_key, ring_key_id
from mrtr_keys.ring.model import CodecSpec, Key, KeyRing


def rewrap(
    keystore: Keystore,
    kms_key_id: str,
    *,
    service: KMSService | None = None,
    now: datetime | None = None,
    listeners: Sequence[ChangeListener] = (),
) -> ChangeResult:
    """Re-wrap every usable data key of the stored KMS ring under `kms_key_id` (ARN, key id or alias).

    The target is resolved to its key ARN with ``DescribeKey`` (it must be an enabled symmetric
    key); the ring then records that ARN. ``details``: ``kms_key_id`` (the ARN), ``from`` (the
    previous ARN), ``rewrapped`` (kids), ``retired_skipped`` (kids).

    Raises:
        ConfigError: the ring is not a KMS ring, or the target key is unknown, disabled or denied.
        UnwrapError: a key's recorded context or key does not match the ring, or KMS refused it.
        BackendUnavailable: KMS unreachable; ConflictError: another writer saved first.
        Nothing is saved when anything raises.
    """
    if not kms_key_id:
        raise ConfigError("--kms-key-id must name the KMS key to re-wrap under (ARN, key id or alias)")
    svc = service or KMSService()

    def transform(ring: KeyRing, at: datetime) -> ChangeResult:
        if ring.codec.type != "kms":
            raise ConfigError(f"rewrap applies to kms key rings; this one uses the {ring.codec.type!r} codec")
        source = ring_key_id(ring)
        target = svc.key_arn(kms_key_id)
        usable = ring.usable_keys()
        wrapped = {k.kid: checked_wrapped_key(ring, k, source) for k in usable}
        retired = [k.kid for k in ring.keys if not k.usable]
        details: dict[str, object] = {"kms_key_id": target, "from": source, "retired_skipped": retired}
        if source == target:
            return ChangeResult(
                "rewrap",
                False,
                ring,
                f"every usable key is already wrapped under {target}; nothing to do",
                details={**details, "rewrapped": []},
            )
        keys: list[Key] = []
        for key in ring.keys:
            if key.kid in wrapped:
                new = svc.re_encrypt(
                    wrapped[key.kid],
                    source_key_id=source,
                    destination_key_id=target,
                    context=wrapped[key.kid].context,
                    kid=key.kid,
                )
                key = replace(key, key_data=new.to_key_data())
            keys.append(key)
        after = ring.next_generation(
            keys=tuple(keys), codec=CodecSpec(ring.codec.type, {**ring.codec.params, "kms_key_id": target})
        )
        kids = [k.kid for k in usable]
        return ChangeResult(
            "rewrap",
            True,
            after,
            f"re-wrapped {len(kids)} data key(s) ({', '.join(kids)}) under {target}; kids unchanged, tokens in "
            "flight stay valid. Reload every instance, then the old KMS key may be disabled",
            details={**details, "rewrapped": kids},
        )

    return apply_change(keystore, "rewrap", transform, now=now, listeners=listeners)
