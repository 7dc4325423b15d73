"""A key ring in a Vault / OpenBao KV version 2 secret: ``vault-kv://MOUNT/PATH``.

The ring's JSON document is the secret's one field ``keyring`` (so
``bao kv get -field=keyring secret/mrtr/keyring`` prints exactly what a ring file holds). Every
write is ``POST MOUNT/data/PATH`` with ``options.cas`` set to the version the writer read (0 to
create), so Vault refuses a write that lost a race and nothing is ever overwritten unseen
(API: https://openbao.org/api-docs/secret/kv/kv-v2/, the same in Vault). `revision()` reads only
``MOUNT/metadata/PATH`` and returns its ``current_version``.

The client is the transit codec's (`mrtr_keys.providers.vault.client.VaultClient`): address, token
or AppRole login, namespace and TLS come from the same ``VAULT_*`` / ``BAO_*`` variables. The first
path segment of the URL is the mount (``vault-kv://secret/mrtr/keyring``: mount ``secret``, path
``mrtr/keyring``); a mount with a slash in it is written ``%2F``.

Policies (docs/keystores.md): instances need ``read`` on ``MOUNT/data/PATH`` and
``MOUNT/metadata/PATH``; the writer also ``create`` and ``update`` on ``MOUNT/data/PATH``.
"""

from __future__ import annotations

import os
from typing import NoReturn
from urllib.parse import quote, unquote

from mrtr_keys.errors import (
    BackendUnavailable,
    ConfigError,
    KeyRingExists,
    KeyRingNotFound,
    KeystoreError,
    KeystoreUnavailable,
)
from mrtr_keys.keystores.remote import RemoteKeystore
from mrtr_keys.providers.vault.client import LoginRefused, VaultClient, VaultRefused
from mrtr_keys.ring.model import KeyRing

FIELD = "keyring"
"""The KV field holding the ring's JSON document."""
_CAS_MISMATCH = "check-and-set"
_UPGRADING = "Upgrading from non-versioned to versioned data"
"""Vault's HTTP 400 from a KV mount that is still becoming version 2 (just enabled as ``kv-v2``, or upgraded
from version 1): "This backend will be unavailable for a brief period and will resume service shortly"
(Vault and OpenBao source, ``builtin/logical/kv``). Not a refusal: the same read succeeds a moment later."""


class VaultKVKeystore(RemoteKeystore):
    """The key ring in KV v2 secret `path` of mount `mount`.

    Args:
        mount, path: e.g. ``secret`` and ``mrtr/keyring``.
        client: a `VaultClient` (default: one from the environment, made on first use).
        state_dir: see `mrtr_keys.keystores.state`.
    """

    def __init__(
        self,
        mount: str,
        path: str,
        *,
        client: VaultClient | None = None,
        state_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        mount, path = mount.strip("/"), path.strip("/")
        if not mount or not path or ".." in path.split("/"):
            raise ConfigError("a vault-kv keystore URL names a mount and a path: vault-kv://MOUNT/PATH")
        super().__init__(state_dir=state_dir)
        self.mount, self.path = mount, path
        self.url = f"vault-kv://{quote(mount, safe='')}/{quote(path, safe='/')}"
        self._client = client

    @classmethod
    def from_url(cls, url: str, *, state_dir: str | os.PathLike[str] | None = None) -> VaultKVKeystore:
        """Open ``vault-kv://MOUNT/PATH`` (no query, no credentials in the URL).

        Raises:
            ConfigError: a malformed URL.
        """
        rest = url.split("://", 1)[1]
        if "?" in rest or "#" in rest or "@" in rest.split("/", 1)[0]:
            raise ConfigError("a vault-kv keystore URL is vault-kv://MOUNT/PATH (credentials come from VAULT_*)")
        mount, _, path = rest.partition("/")
        return cls(unquote(mount), unquote(path), state_dir=state_dir)

    def __repr__(self) -> str:
        return f"VaultKVKeystore({self.url!r})"

    @property
    def client(self) -> VaultClient:
        if self._client is None:
            self._client = VaultClient()
        return self._client

    @property
    def _data_path(self) -> str:
        return f"{quote(self.mount, safe='/')}/data/{quote(self.path, safe='/')}"

    @property
    def _metadata_path(self) -> str:
        return f"{quote(self.mount, safe='/')}/metadata/{quote(self.path, safe='/')}"

    def exists(self) -> bool:
        return self._read() is not None

    def revision(self) -> str | None:
        """KV metadata ``current_version`` (one small GET); None when no ring is stored."""
        try:
            meta = self.client.request("get", self._metadata_path)
        except VaultRefused as exc:
            if exc.status == 404 and not _no_mount(exc):
                return None
            self._fail(exc, "read", self._metadata_path)
        except BackendUnavailable as exc:
            self._fail(exc, "read", self._metadata_path)
        version = meta.get("current_version")
        return str(version) if isinstance(version, int) and version > 0 else None

    def load(self) -> KeyRing:
        found = self._read()
        if found is None:
            raise KeyRingNotFound(f"no key ring at {self.url} (create one with: mrtr-keys init --keystore {self.url})")
        return found[0]

    def create(self, ring: KeyRing) -> None:
        with self.locked():
            self._write(ring, cas=0, expected=None)

    def save(self, ring: KeyRing, *, expected_generation: int) -> None:
        with self.locked():
            version = self._version_for(ring, expected_generation)
            self._write(ring, cas=int(version), expected=expected_generation)

    # -- internals ---------------------------------------------------------------------------

    def _read(self) -> tuple[KeyRing, int] | None:
        try:
            answer = self.client.request("get", self._data_path)
        except VaultRefused as exc:
            if exc.status == 404 and not _no_mount(exc):
                return None
            self._fail(exc, "read", self._data_path)
        except BackendUnavailable as exc:
            self._fail(exc, "read", self._data_path)
        data, meta = answer.get("data"), answer.get("metadata")
        text = data.get(FIELD) if isinstance(data, dict) else None
        version = meta.get("version") if isinstance(meta, dict) else None
        if not isinstance(text, str) or not isinstance(version, int):
            raise KeystoreError(f"the secret at {self.url} has no {FIELD!r} field holding a key ring")
        ring = self._parse(text.encode("utf-8"))
        self._remember(ring, str(version))
        return ring, version

    def _current_version(self) -> tuple[int, str] | None:
        found = self._read()
        return None if found is None else (found[0].generation, str(found[1]))

    def _write(self, ring: KeyRing, *, cas: int, expected: int | None) -> None:
        """Write with ``cas``; `expected` is the generation read (None: creating).

        Raises:
            KeyRingExists (creating), ConflictError: Vault refused the check-and-set.
        """
        payload = {"options": {"cas": cas}, "data": {FIELD: ring.dumps().decode("utf-8")}}
        try:
            answer = self.client.request("post", self._data_path, payload, idempotent=False)
        except VaultRefused as exc:
            if exc.status == 400 and any(_CAS_MISMATCH in e for e in exc.errors):
                found = self._read()
                if found is not None and found[0] == ring:
                    return  # our own write, answered late or retried: it is there
                if expected is None:
                    raise KeyRingExists(f"a key ring already exists at {self.url}; it is never overwritten") from None
                raise self._conflict(expected, None if found is None else found[0].generation) from None
            self._fail(exc, "write", self._data_path)
        except BackendUnavailable as exc:
            self._fail(exc, "write", self._data_path)
        version = answer.get("version")
        if isinstance(version, int):
            self._remember(ring, str(version))

    def _fail(self, exc: Exception, op: str, path: str) -> NoReturn:
        if isinstance(exc, LoginRefused):
            raise KeystoreError(f"key ring {self.url}: {exc}") from None
        if isinstance(exc, BackendUnavailable):
            raise KeystoreUnavailable(
                f"key ring {self.url} is unavailable ({exc}); nothing was changed, retry later"
            ) from None
        assert isinstance(exc, VaultRefused)
        if exc.status == 400 and any(_UPGRADING in e for e in exc.errors):
            raise KeystoreUnavailable(
                f"key ring {self.url} is unavailable: Vault is upgrading the KV mount {self.mount!r} to version 2 "
                "(a mount just enabled as kv-v2 does this for a moment); nothing was changed, retry later"
            ) from None
        if exc.status == 403:
            need = "read" if op == "read" else "create and update"
            raise KeystoreError(
                f"key ring {self.url}: permission denied: Vault refused to {op} {path} (HTTP 403); "
                f"the token's policy needs {need!r} on {path!r} (docs/keystores.md)"
            ) from None
        detail = "; ".join(exc.errors) or "no detail"
        if _no_mount(exc):
            raise KeystoreError(
                f"key ring {self.url}: there is no secrets engine mounted at {self.mount!r} (HTTP 404: {detail}); "
                f"enable a KV version 2 engine there: vault secrets enable -path={self.mount} kv-v2 (or bao secrets "
                "enable ...), or fix the first segment of the URL (the mount)"
            ) from None
        raise KeystoreError(f"key ring {self.url}: Vault refused to {op} {path}: HTTP {exc.status}: {detail}") from None


def _no_mount(exc: VaultRefused) -> bool:
    """Vault's answer to a path under no mount: HTTP 404 "no handler for route" (not a missing secret)."""
    return exc.status == 404 and any("no handler for route" in e for e in exc.errors)
