"""Token fingerprints: a keyed hash that lets events for one token be found without storing the token.

``fingerprint = hex(HMAC-SHA256(audit_key, decoded_bytes)[:12])`` (RFC 2104; 96 bits, 24 hex
characters), where ``decoded_bytes`` is `mrtr_keys.token.decoded_bytes` (the prefix text, ``.``,
then the base64url-decoded body). Because it is computed over the decoded bytes, two spellings of
one token (were a decoder ever to accept both) can never get two fingerprints. A text that is not
a ``PREFIX.BODY`` token is hashed under a separate label (``raw:``) so a garbage retry still has a
stable fingerprint. Without the audit key nobody can test a guessed token against the log.

The audit key is 32 random bytes in ``audit.key`` in the ring's state directory (`Keystore.directory`),
mode 0600, created on first use. Every process that should produce matching fingerprints (all
instances writing to one PostgreSQL store, say) needs the same file, like the key ring itself.

A fleet shares one key with ``MRTR_KEYS_AUDIT_KEY_FILE``: the path of a key file provisioned outside
(never created), read instead of ``audit.key`` (symbolic links followed: a Kubernetes Secret volume's files
are links into ``..data``). Such a file may be group-readable only as a Kubernetes Secret volume with
``fsGroup`` writes it: owned by root, mode 0440 (or 0400), nothing for others, no write or execute for the
group (docs/deploy.md). A file of another owner must be 0600 or 0400 as ``audit.key`` is.
"""

from __future__ import annotations

import binascii
import contextlib
import os
import stat
import tempfile
from pathlib import Path

import pybase64
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.hmac import HMAC

from mrtr_keys.errors import ConfigError
from mrtr_keys.files import read_regular
from mrtr_keys.token import MAX_TOKEN_CHARS, decoded_bytes

AUDIT_KEY_FILE = "audit.key"
ENV_AUDIT_KEY_FILE = "MRTR_KEYS_AUDIT_KEY_FILE"
AUDIT_KEY_BYTES = 32
FINGERPRINT_BYTES = 12
_RAW_LABEL = b"raw:"


def load_audit_key(directory: str | os.PathLike[str], *, create: bool = True) -> bytes:
    """Read (or create, mode 0600) the audit key in `directory`.

    Any number of processes may call this at once on a fresh directory: the key is created
    atomically (temporary file, then a hard link), so every one of them reads the same 32 bytes.

    With ``MRTR_KEYS_AUDIT_KEY_FILE`` set, that file is read instead (`load_shared_audit_key`), and
    `directory` and `create` do not matter.

    Raises:
        ConfigError: the file is not 32 bytes, is accessible by group or others, or cannot be
            read or created.
    """
    shared = shared_key_file()
    if shared:
        return load_shared_audit_key(shared)
    path = Path(directory) / AUDIT_KEY_FILE
    if create and not path.exists():
        _create_atomically(path)
    try:
        info, data = read_regular(path, AUDIT_KEY_BYTES, follow=False)
    except OSError as exc:
        raise ConfigError(f"cannot read audit key {path}: {exc.strerror or type(exc).__name__}") from None
    mode = info.st_mode
    if data is None:
        raise ConfigError(f"audit key {path} is not a regular file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"audit key {path} is accessible by group or others; fix with: chmod 600 {path}")
    if len(data) != AUDIT_KEY_BYTES:
        raise ConfigError(f"audit key {path} must hold exactly {AUDIT_KEY_BYTES} bytes")
    return data


def shared_key_file() -> str | None:
    """The fleet's shared audit key file (``MRTR_KEYS_AUDIT_KEY_FILE``), or None (each host's own ``audit.key``)."""
    return os.environ.get(ENV_AUDIT_KEY_FILE, "").strip() or None


def load_shared_audit_key(path: str | os.PathLike[str]) -> bytes:
    """Read the fleet's shared audit key at `path` (``MRTR_KEYS_AUDIT_KEY_FILE``), never creating it.

    Accepted: exactly 32 bytes; no permission for others; the group may only read, and only when root owns
    the file (a Kubernetes Secret volume with ``fsGroup``: root, mode 0440). Its content never appears in
    a message.

    Raises:
        ConfigError: missing or unreadable, not 32 bytes, or permissions wider than the above.
    """
    try:
        info, data = read_regular(path, AUDIT_KEY_BYTES)  # follows links: a Secret volume's files are links into ..data
    except OSError as exc:
        raise ConfigError(
            f"cannot read the audit key {path} ({ENV_AUDIT_KEY_FILE}): {exc.strerror or type(exc).__name__}"
        ) from None
    if data is None:
        raise ConfigError(f"the audit key {path} ({ENV_AUDIT_KEY_FILE}) is not a regular file")
    group_read_ok = info.st_uid == 0
    allowed_group = stat.S_IRGRP if group_read_ok else 0
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) & ~allowed_group:
        raise ConfigError(
            f"the audit key {path} ({ENV_AUDIT_KEY_FILE}) is accessible by others, or by its group and not "
            "owned by root: mount it from a Kubernetes Secret (defaultMode 0440) or chmod 600 it"
        )
    if len(data) != AUDIT_KEY_BYTES:
        raise ConfigError(f"the audit key {path} ({ENV_AUDIT_KEY_FILE}) must hold exactly {AUDIT_KEY_BYTES} bytes")
    return data


def _create_atomically(path: Path) -> None:
    """Write a new key to a private temporary file, then hard-link it to `path`: a reader sees no
    file or the whole key, never an empty one; if another process linked first, theirs is kept."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{AUDIT_KEY_FILE}.", dir=path.parent)  # mode 0600
    except OSError as exc:
        raise ConfigError(f"cannot create audit key {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(AUDIT_KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process created it first: use theirs
        except OSError as exc:
            raise ConfigError(f"cannot create audit key {path}: {exc.strerror}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def canonical_spelling(token: str) -> str:
    """`token` in the one spelling codecs mint (unpadded base64url), if it is another spelling of
    a ``PREFIX.BODY`` token (the standard alphabet's ``+`` and ``/``, ``=`` padding); else `token`
    unchanged. For looking a token up (``audit fingerprint``, ``query --token``): a respelled
    token then finds the events of the token it spells, not a ``raw:`` fingerprint of its text.
    """
    if decoded_bytes(token) is not None or len(token) > MAX_TOKEN_CHARS:
        return token
    head, dot, body = token.partition(".")
    if not dot:
        return token
    respelled = head + "." + body.replace("+", "-").replace("/", "_").rstrip("=")
    return respelled if decoded_bytes(respelled) is not None else token


def fingerprint_input(token: str) -> bytes:
    """The bytes the fingerprint is computed over: `decoded_bytes(token)`, else ``raw:`` + the text."""
    decoded = decoded_bytes(token)
    if decoded is not None:
        return decoded
    return _RAW_LABEL + token[:MAX_TOKEN_CHARS].encode("utf-8", "surrogatepass")


class Fingerprinter:
    """`fingerprint(token) -> 24 hex chars` under one audit key (bytes copied; never in repr).

    HMAC-SHA256 (RFC 2104) by `cryptography` (OpenSSL): one keyed context is built here and
    copied for each fingerprint, so the key schedule and the algorithm lookup happen once, not per
    token. Safe to share between threads (each call works on its own copy).
    """

    __slots__ = ("_key", "_keyed")

    def __init__(self, key: bytes) -> None:
        if len(key) != AUDIT_KEY_BYTES:
            raise ValueError(f"an audit key is {AUDIT_KEY_BYTES} bytes")
        self._key = bytes(key)
        self._keyed = HMAC(self._key, SHA256())

    def __repr__(self) -> str:
        return "Fingerprinter(<audit key>)"

    def key_bytes(self) -> bytes:
        """The audit key, for handing to the audit writer process through its private pipe only."""
        return self._key

    def fingerprint(self, token: str) -> str:
        """Fingerprint of any text (decoded as `fingerprint_input` says)."""
        return self.of_bytes(fingerprint_input(token))

    def fingerprint_canonical(self, token: str) -> str:
        """Fingerprint of a token a codec minted or accepted (so canonical): the same value as
        `fingerprint`, decoded without all of `mrtr_keys.token.b64u_decode`'s strictness checks
        (the writer's fast path). Text the fast decoder refuses goes to `fingerprint`."""
        head, dot, body = token.partition(".")
        if not dot or len(token) > MAX_TOKEN_CHARS or not (head.isascii() and head.isalnum()):
            return self.fingerprint(token)
        try:
            # validate=True: any character outside the alphabet (or misplaced padding) is refused.
            raw = pybase64.b64decode(body + _PAD[len(body) & 3], altchars=b"-_", validate=True)
        except (binascii.Error, ValueError, TypeError):
            return self.fingerprint(token)
        mac = self._keyed.copy()
        mac.update(head.encode("ascii") + b"." + raw)
        return mac.finalize()[:FINGERPRINT_BYTES].hex()

    def of_bytes(self, data: bytes) -> str:
        """Fingerprint of already-decoded bytes (see `fingerprint_input`)."""
        mac = self._keyed.copy()
        mac.update(data)
        return mac.finalize()[:FINGERPRINT_BYTES].hex()


_PAD = ("", "===", "==", "=")
"""Padding completing a body of length 0, 1, 2, 3 mod 4 (1 mod 4 is never valid base64, and the
decoder refuses it)."""
