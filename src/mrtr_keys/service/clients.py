"""The sidecar's client registry: who may seal or unseal for which audience.

A client is a name, the audiences it was granted, the operations it may run
(``seal``, ``unseal``) and a hash of its bearer secret. The registry lives in
one JSON file in the ring's state directory (``clients.json``; see
`mrtr_keys.keystores.state`) unless configured elsewhere, written atomically with mode 0600.

Document (``format`` = ``mrtr-keys.clients``, ``version`` = 1)::

    {"format": "mrtr-keys.clients", "version": 1,
     "clients": [{"name": "billing", "audiences": ["billing"], "ops": ["seal", "unseal"],
                  "secret_sha256": "<64 hex>", "created_at": "2026-11-29T23:00:00Z"}]}

Secrets and why a plain hash is enough: a secret is ``mks_`` followed by the
unpadded base64url of 32 bytes from the OS CSPRNG (256 bits). Password KDFs
(scrypt, Argon2, PBKDF2) exist to slow down guessing of *low-entropy* human
passwords; guessing a 256-bit random value is infeasible at any hash speed, so
a stolen registry reveals nothing usable either way, and a slow KDF would only
cost every request milliseconds of CPU. We store SHA-256 over a domain-separation
prefix and the secret (the same reasoning GitHub and Stripe apply to API tokens),
look it up in a dict keyed by that hash (O(1)), and compare the stored and
computed digests with `hmac.compare_digest`. Timing of the dict lookup leaks at
most a prefix of the *hash* of a guess, which does not help find a preimage.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from mrtr_keys.changes.scope import check_name
from mrtr_keys.errors import ConfigError, KeystoreError
from mrtr_keys.ring.model import format_time, parse_time, utcnow

FORMAT = "mrtr-keys.clients"
VERSION = 1
ENV_CLIENTS = "MRTR_KEYS_CLIENTS"
DEFAULT_FILENAME = "clients.json"
SECRET_PREFIX = "mks_"  # noqa: S105 - marks a secret's type for scanners, not a secret
SECRET_BYTES = 32
SECRET_HASH_INFO = b"mrtr-keys/v1/client-secret:"
"""Domain separation for the stored SHA-256 of a client secret."""
OPS = ("seal", "unseal")
MAX_REGISTRY_BYTES = 4 * 1024 * 1024
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def hash_secret(secret: str | bytes) -> str:
    """Lowercase hex SHA-256 of `SECRET_HASH_INFO` + the secret's UTF-8 bytes (64 characters)."""
    raw = secret.encode("utf-8", "surrogatepass") if isinstance(secret, str) else secret
    return hashlib.sha256(SECRET_HASH_INFO + raw).hexdigest()


def new_secret() -> str:
    """A fresh bearer secret: ``mks_`` + unpadded base64url of 32 random bytes (256 bits)."""
    return SECRET_PREFIX + secrets.token_urlsafe(SECRET_BYTES)


def check_client_name(name: str) -> str:
    """Return `name` if it is 1-64 characters of ``A-Z a-z 0-9 . _ -`` starting with a letter or digit."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ConfigError("a client name is 1-64 characters of A-Z a-z 0-9 . _ - starting with a letter or digit")
    return name


def parse_ops(ops: Iterable[str]) -> tuple[str, ...]:
    """Normalise operations (``seal``, ``unseal``; comma-separated items allowed) to a sorted tuple."""
    out: set[str] = set()
    for item in ops:
        for op in str(item).split(","):
            op = op.strip()
            if not op:
                continue
            if op not in OPS:
                raise ConfigError(f"unknown operation {op!r} (use seal, unseal or seal,unseal)")
            out.add(op)
    if not out:
        raise ConfigError("a client needs at least one operation (seal, unseal)")
    return tuple(o for o in OPS if o in out)


@dataclass(frozen=True, slots=True)
class Client:
    """One registered client. Holds only the hash of its secret."""

    name: str
    audiences: frozenset[str]
    ops: frozenset[str]
    secret_sha256: str
    created_at: datetime

    def allows(self, op: str, audience: str) -> bool:
        """True if this client was granted `op` for `audience` (exact, case-sensitive)."""
        return op in self.ops and audience in self.audiences

    def describe(self) -> dict[str, Any]:
        """Public fields: name, audiences, ops, created_at (no hash)."""
        return {
            "name": self.name,
            "audiences": sorted(self.audiences),
            "ops": [o for o in OPS if o in self.ops],
            "created_at": format_time(self.created_at),
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.describe(), "secret_sha256": self.secret_sha256}


class ClientRegistry:
    """An immutable set of clients with an O(1) lookup by secret."""

    def __init__(self, clients: Iterable[Client] = ()) -> None:
        self._by_name: dict[str, Client] = {}
        self._by_hash: dict[str, Client] = {}
        for c in clients:
            if c.name in self._by_name:
                raise ConfigError(f"client registry: duplicate client {c.name!r}")
            if c.secret_sha256 in self._by_hash:
                raise ConfigError(f"client registry: client {c.name!r} shares a secret with another client")
            self._by_name[c.name] = c
            self._by_hash[c.secret_sha256] = c

    def __len__(self) -> int:
        return len(self._by_name)

    def __iter__(self) -> Iterator[Client]:
        return iter(sorted(self._by_name.values(), key=lambda c: c.name))

    def __repr__(self) -> str:
        return f"ClientRegistry({sorted(self._by_name)})"

    def get(self, name: str) -> Client | None:
        return self._by_name.get(name)

    def authenticate(self, secret: str | bytes) -> Client | None:
        """The client whose secret this is, or None (see the module docstring for the scheme)."""
        digest = hash_secret(secret)
        client = self._by_hash.get(digest)
        if client is None or not hmac.compare_digest(client.secret_sha256, digest):
            return None
        return client

    def audiences(self) -> frozenset[str]:
        """Every audience granted to some client."""
        out: set[str] = set()
        for c in self._by_name.values():
            out |= c.audiences
        return frozenset(out)

    def with_client(self, client: Client) -> ClientRegistry:
        if client.name in self._by_name:
            raise ConfigError(f"client {client.name!r} already exists; remove it first to issue a new secret")
        return ClientRegistry([*self._by_name.values(), client])

    def without(self, name: str) -> ClientRegistry:
        if name not in self._by_name:
            raise ConfigError(f"no client named {name!r}")
        return ClientRegistry(c for c in self._by_name.values() if c.name != name)

    def dumps(self) -> bytes:
        doc = {"format": FORMAT, "version": VERSION, "clients": [c.to_json() for c in self]}
        return (json.dumps(doc, indent=2) + "\n").encode("utf-8")

    @classmethod
    def loads(cls, data: bytes | str) -> ClientRegistry:
        """Parse and validate a registry document.

        Raises:
            ConfigError: one line naming what is wrong.
        """
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ConfigError("client registry is not valid JSON") from None
        except RecursionError:
            raise ConfigError("client registry JSON is nested too deeply") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ConfigError(f"not a client registry (format must be {FORMAT!r})")
        if doc.get("version") != VERSION:
            raise ConfigError(f"unsupported client registry version {doc.get('version')!r}")
        raw = doc.get("clients")
        if not isinstance(raw, list):
            raise ConfigError("client registry: clients must be a list")
        return cls(_client_from_json(entry, i) for i, entry in enumerate(raw))


def _client_from_json(entry: object, index: int) -> Client:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"client registry: clients[{index}] must be an object")
    name = check_client_name(str(entry.get("name", "")))
    audiences = entry.get("audiences")
    if not isinstance(audiences, list) or not all(isinstance(a, str) for a in audiences):
        raise ConfigError(f"client registry: {name}: audiences must be a list of strings")
    for a in audiences:
        check_name(a)
    ops = entry.get("ops")
    if not isinstance(ops, list):
        raise ConfigError(f"client registry: {name}: ops must be a list")
    digest = entry.get("secret_sha256")
    if not isinstance(digest, str) or re.fullmatch(r"[0-9a-f]{64}", digest) is None:
        raise ConfigError(f"client registry: {name}: secret_sha256 must be 64 lowercase hex characters")
    created = parse_time(entry.get("created_at"), f"client {name} created_at") or utcnow()
    return Client(name, frozenset(audiences), frozenset(parse_ops(ops)), digest, created)


def registry_path(keystore_directory: Path | None, override: str | os.PathLike[str] | None = None) -> Path:
    """Where the registry lives: `override`, else ``MRTR_KEYS_CLIENTS``, else ``clients.json`` in the
    state directory (`keystore_directory`, `Keystore.directory`)."""
    if override is not None and str(override):
        return Path(override).expanduser().absolute()
    env = os.environ.get(ENV_CLIENTS)
    if env:
        return Path(env).expanduser().absolute()
    if keystore_directory is None:
        raise ConfigError(f"no client registry location: set --clients or {ENV_CLIENTS}")
    return keystore_directory / DEFAULT_FILENAME


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What changes when a file is replaced (inode, size, mtime in ns); None fields for a missing file."""

    ino: int | None
    size: int | None
    mtime_ns: int | None


def file_stamp(path: Path) -> FileStamp:
    try:
        st = os.stat(path)
    except OSError:
        return FileStamp(None, None, None)
    return FileStamp(st.st_ino, st.st_size, st.st_mtime_ns)


def load_registry(path: Path) -> ClientRegistry:
    """Read the registry at `path`; a missing file is an empty registry.

    Raises:
        ConfigError: the document is invalid. KeystoreError: unreadable, or accessible by group/others
            (group read is accepted on a read-only mount: `mrtr_keys.keystores.private`).
    """
    from mrtr_keys.keystores.private import read_private_file

    try:
        data = read_private_file(path, "client registry", max_bytes=MAX_REGISTRY_BYTES, missing=FileNotFoundError())
    except FileNotFoundError:
        return ClientRegistry()
    return ClientRegistry.loads(data)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _write(path: Path, registry: ClientRegistry) -> None:
    data = registry.dumps()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise KeystoreError(f"cannot write client registry {path}: {exc.strerror}") from None


def add_client(
    path: Path, name: str, *, audiences: Iterable[str], ops: Iterable[str] = OPS, now: datetime | None = None
) -> tuple[Client, str]:
    """Register a client; returns it and its new secret (shown once, never stored).

    Raises:
        ConfigError: bad name, audience or operation; the name is taken.
    """
    check_client_name(name)
    auds = tuple(dict.fromkeys(check_name(a) for a in audiences))
    if not auds:
        raise ConfigError("a client needs at least one --audience")
    secret = new_secret()
    client = Client(name, frozenset(auds), frozenset(parse_ops(ops)), hash_secret(secret), now or utcnow())
    with _locked(path):
        _write(path, load_registry(path).with_client(client))
    return client, secret


def remove_client(path: Path, name: str) -> Client:
    """Remove a client by name; returns what was removed. Raises `ConfigError` if absent."""
    with _locked(path):
        registry = load_registry(path)
        client = registry.get(name)
        _write(path, registry.without(name))
    assert client is not None
    return client
