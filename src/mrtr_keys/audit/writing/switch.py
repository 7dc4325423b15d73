"""The store's switch to keyed links: recorded once by the first writer that keys, read by every verifier.

A store written before chain version 2 holds unkeyed links (`mrtr_keys.audit.writing.chain_key`). The first
writer that links with a chain key records, in ``store_meta`` (name `NAME`), where the switch happened::

    {"version": 2, "position": P, "key_id": K, "time": T, "store_id": S, "mac": "v2:K:..."}

P is the highest storage position in use when it was recorded (0 for a new store), K the writer's key
id, and the MAC (`ChainKey.sign`) binds all of it to the chain key and the store. ``verify`` then
holds every chain that begins after P to keyed links from its first batch, and every chain to keyed
links once it has one (a chain that began before P, a writer of the old release still running during
the upgrade, may go on unkeyed until it ends). What it cannot catch: a rewrite of the unkeyed records
before the switch by someone who recomputes their SHA-256 links (checkpoints and anchors catch that),
and, the store being writable, the switch record deleted together with every keyed record rewritten
unkeyed (a checkpoint or anchor of a keyed head catches that; ``verify`` also counts the records it
verified keyed and unkeyed).

**Whose keys may link in one store.** A host's own audit key (``audit.key`` in its state directory, the
default) may write to a store only if the store's switch names that key, or names none yet: a second
host with a key of its own is refused (`ConfigError`) instead of writing chains no other host could
verify. A fleet key (``MRTR_KEYS_AUDIT_KEY_FILE``) may link under a new key id: that is how the key is
rotated (verifiers then read the retired key from ``MRTR_KEYS_AUDIT_OLD_KEY_FILES``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from mrtr_keys.audit.events import format_ts
from mrtr_keys.audit.writing.chain_key import MAC, VERSION, ChainKey, ChainKeys
from mrtr_keys.errors import AuditError, ConfigError

NAME = "chain_switch"
"""The ``store_meta`` name of the switch record."""
STORE = "store"
"""`Break.kind` of a problem with the store as a whole (its switch record), not with one chain."""


@dataclass(frozen=True)
class Switch:
    """A store's switch to keyed links, as read (`problem` set when its MAC or key do not hold)."""

    position: int
    key_id: str
    time: str
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"position": self.position, "key_id": self.key_id, "time": self.time}


def has_meta(store: Any) -> bool:
    """True for a store that keeps ``store_meta`` (SQLite, PostgreSQL; not a JSON-lines log)."""
    return hasattr(store, "put_meta_once")


def writer_key(store: Any, audit_key: bytes, given: ChainKey | None = None) -> ChainKey:
    """The chain key a writer of `store` links with: `given`, else the one derived from `audit_key` (a fleet
    key when ``MRTR_KEYS_AUDIT_KEY_FILE`` names the file), once `ensure` accepted it.

    Raises:
        ConfigError: a host key other than the store's; AuditError: the store cannot be read or written.
    """
    from mrtr_keys.audit.writing.fingerprint import shared_key_file

    key = given or ChainKey(audit_key, fleet=shared_key_file() is not None)
    ensure(store, key)
    return key


def ensure(store: Any, key: ChainKey, *, now: float | None = None) -> None:
    """Record the switch in `store` if it has none, before `key` links anything there; refuse a host's
    own key that is not the one the switch names (see the module docstring).

    Raises:
        ConfigError: a host key other than the store's; AuditError: the store cannot be read or written.
    """
    if not has_meta(store):
        return
    raw = store.meta(NAME)
    if raw is None:
        doc = {
            "version": VERSION,
            "position": int(store.last_position()),
            "key_id": key.key_id,
            "time": format_ts(time.time() if now is None else now),
            "store_id": getattr(store, "store_id", None),
        }
        raw = store.put_meta_once(NAME, json.dumps(key.sign(doc), separators=(",", ":"), sort_keys=True))
    recorded = _parse(raw)
    if recorded is None:
        raise AuditError(f"the audit store {store.url} holds a malformed {NAME} record in store_meta")
    their = str(recorded.get("key_id"))
    if their != key.key_id and not key.fleet:
        raise ConfigError(
            f"the audit store {store.url} is chained under chain key id {their} (since {recorded.get('time')}), but "
            f"this process's audit key (its state directory's audit.key) has id {key.key_id}: every writer of one "
            "store needs the fleet's audit key (MRTR_KEYS_AUDIT_KEY_FILE; docs/audit.md, Keyed links), or the "
            "links it wrote could not be verified anywhere else"
        )


def read(store: Any, keys: ChainKeys) -> Switch | None:
    """The switch recorded in `store` (None: none, or a store without ``store_meta``), with `problem`
    saying why it cannot be trusted (malformed, another key, a MAC that does not hold).

    Raises:
        AuditError: the store cannot be read.
    """
    if not has_meta(store):
        return None
    raw = store.meta(NAME)
    if raw is None:
        return None
    doc = _parse(raw)
    if doc is None or not isinstance(doc.get("position"), int) or not isinstance(doc.get("key_id"), str):
        return Switch(0, "?", "?", f"the {NAME} record in store_meta is malformed")
    problem = keys.doc_problem(doc)
    if problem is None and doc.get("store_id") != getattr(store, "store_id", None):
        problem = "it names another store id (copied from another store)"
    said = f"the {NAME} record in store_meta: {problem}" if problem else None
    return Switch(int(doc["position"]), str(doc["key_id"]), str(doc.get("time")), said)


def _parse(raw: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # nested too deeply for the parser: malformed like any other
        return None
    return doc if isinstance(doc, dict) and MAC in doc else None


__all__ = ["NAME", "STORE", "ChainKey", "Switch", "ensure", "has_meta", "read", "writer_key"]
