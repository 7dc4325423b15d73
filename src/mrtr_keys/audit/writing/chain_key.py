"""The chain key: keyed batch links (chain version 2), and MACs of the records we trust (checkpoints, anchors).

A batch's link was SHA-256 over the previous link and the rows' text (`mrtr_keys.audit.writing.chain.batch_hash`):
anyone able to write the store could recompute every link after an edit. From chain version 2 a link
is an HMAC-SHA256 (RFC 2104) under a **chain key** the store does not hold::

    hash = "v2:" + KEY_ID + ":" + hex(HMAC-SHA256(chain_key, "v2:" + KEY_ID + ":" + prev_hash + repr(rows)))

(`LINK_CHARS` = 76 characters; ``prev_hash`` is the previous batch's ``hash`` text, whichever version it
has, so a chain goes on across the switch). The version and key id are in the text the MAC covers, so
neither can be changed without the key. A link without the prefix is a version 1 link (64 hex
characters), verified as before.

Where the key comes from (docs/audit.md, "Keyed links"): it is derived, with HKDF-SHA256 (RFC 5869) and
the label `CHAIN_INFO`, from the **audit key** every writer already holds for fingerprints: the fleet's
shared file (``MRTR_KEYS_AUDIT_KEY_FILE``) or else ``audit.key`` in the state directory. One secret to
provision and rotate, read by writers and verifiers the same way; the fingerprint key and the chain key
are still distinct keys (another HKDF label). Its **key id** (`KEY_ID_CHARS` hex characters) is an HMAC
of a fixed label under the chain key: it names the key without revealing anything about it, so a
verifier holding several keys (the current one and retired ones, ``MRTR_KEYS_AUDIT_OLD_KEY_FILES``)
picks the right one for each link. Whether one store may hold the links of several hosts' own keys is
the writers' rule (`mrtr_keys.audit.writing.switch`).

The same key MACs the records verify trusts from outside the store (`doc_mac`): checkpoint records and
the anchors the service writes, so whoever can write where they are kept cannot forge one without it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from mrtr_keys.errors import ConfigError

VERSION = 2
"""The keyed chain version (version 1: SHA-256 links)."""
PREFIX = "v2:"
"""How a keyed link's text starts."""
KEY_ID_CHARS = 8
LINK_CHARS = len(PREFIX) + KEY_ID_CHARS + 1 + 64
CHAIN_INFO = b"mrtr-keys audit chain key v2"
"""HKDF ``info`` deriving the chain key from the audit key (the fingerprint HMAC uses the audit key as is)."""
KEY_ID_INFO = b"mrtr-keys audit chain key id"
"""Message whose HMAC under the chain key is its key id."""
DOC_INFO = b"mrtr-keys audit trusted record v2\n"
"""Prefix of a MACed record's bytes (never the start of a link's MAC input, which is `PREFIX`)."""
MAC = "mac"
"""The field of a checkpoint or anchor record that holds its MAC."""
ENV_OLD_KEY_FILES = "MRTR_KEYS_AUDIT_OLD_KEY_FILES"
"""Retired audit key files a verifier also reads (``os.pathsep``-separated), for links made before a rotation."""


def is_keyed(link: object) -> bool:
    """True for a version 2 link text (`PREFIX`)."""
    return link.__class__ is str and link.startswith(PREFIX)  # type: ignore[attr-defined]


class ChainKey:
    """One chain key, derived from an audit key (32 bytes; copied, never in ``repr``).

    `fleet`: the audit key is the fleet's shared file (``MRTR_KEYS_AUDIT_KEY_FILE``), not a host's own
    ``audit.key`` (`mrtr_keys.audit.writing.switch` lets only a fleet key add a key id to a store).
    """

    __slots__ = ("_key", "fleet", "key_id", "prefix")

    def __init__(self, audit_key: bytes, *, fleet: bool = False) -> None:
        if len(audit_key) != 32:
            raise ValueError("an audit key is 32 bytes")
        self._set(HKDF(algorithm=SHA256(), length=32, salt=None, info=CHAIN_INFO).derive(bytes(audit_key)), fleet)

    def _set(self, key: bytes, fleet: bool) -> None:
        self._key = key
        self.key_id = hmac.digest(key, KEY_ID_INFO, "sha256")[: KEY_ID_CHARS // 2].hex()
        self.prefix = f"{PREFIX}{self.key_id}:"
        self.fleet = fleet

    def material(self) -> bytes:
        """The chain key itself, for a child process of this one that verifies links, through its private
        pipe only (`mrtr_keys.audit.retention.child`); never logged."""
        return self._key

    @classmethod
    def from_material(cls, material: bytes) -> ChainKey:
        """The chain key `material` (as `material` gave it; 32 bytes)."""
        if len(material) != 32:
            raise ValueError("a chain key is 32 bytes")
        key = cls.__new__(cls)
        key._set(bytes(material), False)
        return key

    def __repr__(self) -> str:
        return f"ChainKey(<key id {self.key_id}>)"

    def link(self, prev_hash: str, rows_text: str) -> str:
        """The link of a batch whose rows' ``repr`` is `rows_text`, after `prev_hash`."""
        message = (self.prefix + prev_hash + rows_text).encode("utf-8", "surrogatepass")
        return self.prefix + hmac.digest(self._key, message, "sha256").hex()

    def hasher(self, prev_hash: str) -> Any:
        """An incremental form of `link` (``update(bytes)``, then ``self.prefix + hexdigest()``), fed
        the rows' text after `prev_hash` (a batch too long to hold, `mrtr_keys.audit.verifying.verify_stream`)."""
        return hmac.new(self._key, (self.prefix + prev_hash).encode("utf-8", "surrogatepass"), hashlib.sha256)

    def doc_mac(self, doc: dict[str, Any]) -> str:
        """The MAC of a trusted record (every field but `MAC`, as canonical JSON: sorted keys, no spaces)."""
        body = json.dumps({k: v for k, v in doc.items() if k != MAC}, sort_keys=True, separators=(",", ":"))
        return self.prefix + hmac.digest(self._key, DOC_INFO + body.encode("utf-8", "surrogatepass"), "sha256").hex()

    def sign(self, doc: dict[str, Any]) -> dict[str, Any]:
        """`doc` with its `MAC` field set (in place; returned)."""
        doc[MAC] = self.doc_mac(doc)
        return doc


class ChainKeys:
    """The chain keys a verifier holds: the current one first, then retired ones, by key id."""

    def __init__(self, keys: Sequence[ChainKey]) -> None:
        if not keys:
            raise ValueError("at least one chain key")
        self.current = keys[0]
        self._by_id = {k.key_id: k for k in reversed(keys)}

    def __repr__(self) -> str:
        return f"ChainKeys({', '.join(self._by_id)})"

    @property
    def ids(self) -> list[str]:
        return list(self._by_id)

    def all(self) -> list[ChainKey]:
        return list(self._by_id.values())

    def get(self, key_id: str) -> ChainKey | None:
        return self._by_id.get(key_id)

    def of_link(self, link: str) -> ChainKey | None:
        """The key a keyed `link` names (None: not one of ours)."""
        return self._by_id.get(link[len(PREFIX) : len(PREFIX) + KEY_ID_CHARS])

    def doc_problem(self, doc: dict[str, Any]) -> str | None:
        """Why `doc`'s `MAC` does not hold (None: it does; a record without one is the caller's rule)."""
        mac = doc.get(MAC)
        if not is_keyed(mac):
            return "its MAC is not a keyed MAC"
        key = self.of_link(str(mac))
        if key is None:
            return f"it is MACed under chain key id {str(mac)[3:11]!r}, not a key this verifier holds"
        if not hmac.compare_digest(key.doc_mac(doc), str(mac)):
            return "its MAC does not match its content (changed after it was written)"
        return None


def key_id_of(link: str) -> str:
    """The key id a keyed link names."""
    return link[len(PREFIX) : len(PREFIX) + KEY_ID_CHARS]


def chain_key(directory: str | os.PathLike[str], *, create: bool = True) -> ChainKey:
    """The chain key a writer in state directory `directory` links with: from the audit key it
    fingerprints with (`mrtr_keys.audit.writing.fingerprint.load_audit_key`).

    Raises:
        ConfigError: the audit key cannot be read (or created).
    """
    from mrtr_keys.audit.writing.fingerprint import load_audit_key, shared_key_file

    return ChainKey(load_audit_key(directory, create=create), fleet=shared_key_file() is not None)


def verifier_keys(directory: str | os.PathLike[str], command: str = "audit verify") -> ChainKeys:
    """The keys `command` (``audit verify``, ``prune``, ``archive``, ``checkpoint``) checks links with,
    read as a writer reads its key (``MRTR_KEYS_AUDIT_KEY_FILE``, else ``audit.key`` in `directory`,
    never created), plus the retired keys in ``MRTR_KEYS_AUDIT_OLD_KEY_FILES``.

    Raises:
        ConfigError: one line saying which key is missing (a verifier without the key would verify
            less than it claims, so it does not run).
    """
    from mrtr_keys.audit.writing.fingerprint import ENV_AUDIT_KEY_FILE

    try:
        keys = [chain_key(directory, create=False)]
    except ConfigError as exc:
        raise ConfigError(
            f"{command} needs the audit chain key, read as the writers read it: {exc} (set {ENV_AUDIT_KEY_FILE} to "
            "the fleet's audit key file, or run it where the writers' state directory is: --keystore / --state-dir)"
        ) from None
    return ChainKeys(keys + [ChainKey(k) for k in old_audit_keys()])


def old_audit_keys() -> list[bytes]:
    """The retired audit keys named by ``MRTR_KEYS_AUDIT_OLD_KEY_FILES`` (read like the fleet's key file).

    Raises:
        ConfigError: one of them cannot be read or is not a key.
    """
    from mrtr_keys.audit.writing.fingerprint import ENV_AUDIT_KEY_FILE, load_shared_audit_key

    out = []
    for path in _old_files(os.environ.get(ENV_OLD_KEY_FILES, "")):
        try:
            out.append(load_shared_audit_key(path))
        except ConfigError as exc:
            raise ConfigError(f"{ENV_OLD_KEY_FILES}: {exc}".replace(f" ({ENV_AUDIT_KEY_FILE})", "")) from None
    return out


def _old_files(value: str) -> Iterable[str]:
    return [p for p in (s.strip() for s in value.split(os.pathsep)) if p]
