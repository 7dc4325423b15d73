"""Revoking a key: a leaked key stops opening and sealing tokens on every instance, for good.

`revoke` is a pure transition on a `KeyRing` (saved by `mrtr_keys.changes.apply.apply_change` as the
next generation, which every instance loads within its check interval). It has no gate: the rotation
gates exist to keep rounds in flight valid, and a revocation is meant to break the rounds of a leaked
key (``mrtr-keys keys revoke`` prints which before it writes, `mrtr_keys.fleet.revoke_estimate`).

* a ``verify`` key (the key a ``begin`` added, or the old key after a ``promote``) becomes ``revoked``;
* the ``primary`` becomes ``revoked`` and, in the same generation, another key seals: the key a
  ``begin`` added when a rotation is begun (promoted now), else a new key from the ring's backend in the
  newest format its codec seals (``mk2``, as ``begin`` makes), promoted at once (a Vault ring rotates its
  transit key for it, as ``begin`` does);
* a ``retired`` key (destroyed or not) becomes ``revoked``, so the record says why it ended;
* a ``revoked`` key: nothing to do (a revocation is final; a key revoked by mistake is replaced by
  rotating on, docs/rotation.md).

The key's material (``material``, or the wrapped key in ``key_data``) is removed in the same change
(``destroyed_at`` is set), unless `keep_material`: a later leak of the stored ring (a backup, an old copy)
then cannot open the leaked key's tokens either. The key keeps its record: ``revoked_at``,
``revoked_reason``, ``revoked_by``.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from mrtr_keys.backends import Backend, key_format_for
from mrtr_keys.changes.apply import ChangeResult
from mrtr_keys.changes.rotation import Phase, status
from mrtr_keys.errors import ConfigError, UnknownKid
from mrtr_keys.ring.model import MAX_REVOKED_REASON, Key, KeyRing, KeyState, format_time, new_kid

OP = "revoke"


def check_reason(text: object, what: str = "--reason") -> str:
    """`text` as a revocation reason or author: one line of 1 to `MAX_REVOKED_REASON` printable characters.

    Raises:
        ConfigError: empty, too long, or holding a control character (a newline would forge log lines).
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{what} must say why the key is revoked (e.g. 'ring file found in a public backup')")
    if len(text) > MAX_REVOKED_REASON or not text.isprintable():
        raise ConfigError(f"{what} must be one line of at most {MAX_REVOKED_REASON} printable characters")
    return text.strip()


def revoke(
    ring: KeyRing,
    kid: str,
    now: datetime,
    *,
    reason: str,
    by: str,
    backend: Backend,
    keep_material: bool = False,
    forced: bool = False,
) -> ChangeResult:
    """Revoke `kid` in `ring` at `now` (see the module docstring).

    Args:
        reason, by: why, and who (``user@host``); both kept in the ring and the audit record.
        backend: the ring's backend, asked for a new key when the primary is revoked outside a rotation.
        keep_material: keep the key's material in the ring (a forensic copy; ``keys destroy`` removes it later).
        forced: the change passed a fleet check only thanks to ``--force`` (recorded as forced).

    Returns:
        A `ChangeResult` with ``details``: ``kid``, ``was`` (its state before), ``new`` (the kid that
        seals now when the primary was revoked, else None), ``material`` (``removed``, ``kept`` or
        ``none``: already destroyed), ``reason``, ``by``.

    Raises:
        UnknownKid: no key `kid` in the ring (exit 1).
        ConfigError: an empty or multi-line `reason` or `by`.
        BackendUnavailable, ConfigError: the backend could not make the new primary.
    """
    reason, by = check_reason(reason), check_reason(by, "the revoking user")
    key = ring.lookup(kid)
    if key is None:
        raise UnknownKid(f"no key {kid} in key ring {ring.ring_id} (see: mrtr-keys keys list)")
    if key.revoked:
        return ChangeResult(
            OP,
            False,
            ring,
            f"key {kid} was already revoked at {format_time(key.revoked_at)} ({key.revoked_reason}); "
            "a revocation is final",
            details={"kid": kid, "was": key.state.value, "new": None, "material": _material(key), "reason": reason},
        )
    material = "none" if key.destroyed else ("kept" if keep_material else "removed")
    gone = replace(key, state=KeyState.REVOKED, revoked_at=now, revoked_reason=reason, revoked_by=by)
    if material == "removed":
        gone = replace(gone, material=None, key_data={}, destroyed_at=now)
    keys = [gone if k.kid == kid else k for k in ring.keys]
    new: str | None = None
    if key.state is KeyState.PRIMARY:
        successor = _successor(ring, now, backend)
        new = successor.kid
        promoted = replace(successor, state=KeyState.PRIMARY, promoted_at=now, demoted_at=None)
        if ring.lookup(new) is None:
            keys.append(promoted)
        else:
            keys = [promoted if k.kid == new else k for k in keys]
    after = ring.next_generation(keys=tuple(keys))
    seals = f"; {new} seals from now on" if new else ""
    kept = {
        "removed": "its material is removed from the ring",
        "kept": "its material is kept in the ring (--keep-material; remove it with: mrtr-keys keys destroy "
        + kid
        + ")",
        "none": "its material was already destroyed",
    }[material]
    return ChangeResult(
        OP,
        True,
        after,
        f"key {kid} revoked (was {key.state.value}){seals}; {kept}. Every instance refuses its tokens "
        f"(reason 'revoked kid') once it loads generation {after.generation}",
        forced=forced,
        details={"kid": kid, "was": key.state.value, "new": new, "material": material, "reason": reason, "by": by},
    )


def _successor(ring: KeyRing, now: datetime, backend: Backend) -> Key:
    """The key that seals once the primary is revoked: the key a begun rotation added, else a new one."""
    st = status(ring, now)
    if st.phase is Phase.BEGUN and st.new is not None:
        return st.new
    kid = new_kid(k.kid for k in ring.keys)
    # made as a verify key (a Vault ring rotates its transit key for it, as `begin` does), promoted by the caller;
    # in the format `begin` would give it (the backend makes mk1 unless told)
    key = backend.new_key(ring_id=ring.ring_id, kid=kid, state=KeyState.VERIFY, audiences=ring.audiences, now=now)
    return replace(key, format=key_format_for(backend, None))


def _material(key: Key) -> str:
    return "none" if key.destroyed else "kept"
