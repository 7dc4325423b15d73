"""A small, typed client for the HashiCorp Vault / OpenBao transit API, built on hvac.

Settings (address, token, TLS, timeouts) are `VaultSettings` (`settings.py`, from the standard
``VAULT_*`` / ``BAO_*`` environment, never from the key ring); the AppRole and Kubernetes logins, and the
one re-login after a 403, are `Login` (`login.py`). Both names, and the errors, are re-exported here.

Error mapping (one place, `VaultClient.request`):

* transport failure (refused, reset, timeout, TLS) after the retries, or an HTTP
  5xx answer: `BackendUnavailable` (Vault is down, sealed or overloaded);
* a refused AppRole or Kubernetes login: `LoginRefused`, a `BackendUnavailable` (this
  instance cannot use Vault; its tokens are not thereby invalid);
* HTTP 4xx: `VaultRefused`, carrying the status and Vault's error strings (Vault
  never echoes plaintext or key material in them). Callers decide what a refusal
  means: the transit codec turns a refused decrypt into ``InvalidRequestState``.

Retries happen only on transport errors, with a short backoff, and never on an
HTTP answer: a 400 from transit/decrypt (wrong context, corrupted or too-old
ciphertext) is not transient, and repeating it would only double the calls an
attacker can cause. Non-idempotent writes (``keys/<name>/rotate``) are retried
only when the connection was never established.

API reference: https://openbao.org/api-docs/secret/transit/ (identical paths and
fields in Vault: https://developer.hashicorp.com/vault/api-docs/secret/transit).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import quote

from mrtr_keys.errors import BackendUnavailable, ConfigError
from mrtr_keys.providers.vault.errors import LoginRefused, VaultRefused
from mrtr_keys.providers.vault.login import Login
from mrtr_keys.providers.vault.settings import (
    DEFAULT_K8S_TOKEN_FILE,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT_SECONDS,
    VaultSettings,
)

__all__ = [
    "DEFAULT_K8S_TOKEN_FILE",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT_SECONDS",
    "LoginRefused",
    "VaultClient",
    "VaultRefused",
    "VaultSettings",
    "latest_version",
]

RETRY_BACKOFF_SECONDS = 0.05
"""First retry delay (seconds); doubles on each further retry."""


class VaultClient:
    """Thread-safe wrapper over an `hvac.Client` session with our error mapping and retry rule.

    Args:
        settings: see `VaultSettings`; defaults to `VaultSettings.from_env()`.

    Raises:
        ConfigError: bad settings, or hvac is not installed (``pip install 'mrtr-keys[vault]'``).
    """

    def __init__(self, settings: VaultSettings | None = None) -> None:
        try:
            import hvac
            import requests
        except ImportError:  # pragma: no cover - depends on the install
            raise ConfigError("the Vault codec needs hvac: pip install 'mrtr-keys[vault]'") from None
        self.settings = settings or VaultSettings.from_env()
        s = self.settings
        verify: bool | str = s.ca_cert if (s.tls_verify and s.ca_cert) else s.tls_verify
        cert = (s.client_cert, s.client_key) if s.client_cert and s.client_key else None
        self._hvac = hvac.Client(
            url=s.addr,
            token=s.token,
            namespace=s.namespace,
            verify=verify,
            cert=cert,
            timeout=s.timeout,
            adapter=hvac.adapters.RawAdapter,
        )
        self._requests = requests
        self._login = Login(s, self._use_token)

    def _use_token(self, token: str) -> None:
        self._hvac.token = token

    def __repr__(self) -> str:
        return f"VaultClient(addr={self.settings.addr!r}, namespace={self.settings.namespace!r})"

    @property
    def session(self) -> Any:
        """The underlying `requests.Session` (to add hooks, e.g. metrics)."""
        return self._hvac.adapter.session

    def close(self) -> None:
        """Close pooled connections."""
        self._hvac.adapter.close()

    # -- transport -------------------------------------------------------------------------

    def request(
        self, method: str, path: str, payload: Mapping[str, Any] | None = None, *, idempotent: bool = True
    ) -> dict[str, Any]:
        """Send one API request (`path` without ``/v1/``) and return the response's ``data`` object.

        Args:
            idempotent: if False, a request whose connection was established is never sent
                again (only connect failures are retried).

        Raises:
            BackendUnavailable: transport failure after `max_retries` retries, or HTTP 5xx.
            VaultRefused: HTTP 4xx (never retried).
        """
        self._login.ensure(self._post_login)
        try:
            return self._send(method, path, payload, idempotent=idempotent)
        except VaultRefused as exc:
            if exc.status != 403 or not self._login.drop():
                raise
        # the token this instance logged in for was refused: revoked, or lost by a restarted server.
        # A 403 means the request was not served, so one fresh login and one resend are safe.
        self._login.ensure(self._post_login)
        return self._send(method, path, payload, idempotent=idempotent)

    def _post_login(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self._send("post", path, body, idempotent=True)

    def _send(self, method: str, path: str, payload: Mapping[str, Any] | None, *, idempotent: bool) -> dict[str, Any]:
        req = self._requests.exceptions
        attempts = 1 + self.settings.max_retries
        last: Exception | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(RETRY_BACKOFF_SECONDS * (2 ** (attempt - 1)))
            try:
                response = self._hvac.adapter.request(
                    method, f"/v1/{path}", json=dict(payload) if payload is not None else None, raise_exception=False
                )
            except req.ConnectionError as exc:  # includes ConnectTimeout and SSLError
                last = exc
                if idempotent or isinstance(exc, req.ConnectTimeout) or _never_connected(exc):
                    continue
                break
            except req.Timeout as exc:  # read timeout: the request may have been processed
                last = exc
                if idempotent:
                    continue
                break
            except req.RequestException as exc:
                last = exc
                break
            return self._answer(method, path, response)
        kind = type(last).__name__ if last is not None else "error"
        raise BackendUnavailable(
            f"Vault at {self.settings.addr} is unreachable ({kind} on {method.upper()} {path}); "
            "check VAULT_ADDR/BAO_ADDR and that the server is up and unsealed"
        )

    def _answer(self, method: str, path: str, response: Any) -> dict[str, Any]:
        status = int(response.status_code)
        try:
            body = response.json() if response.content else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        if status >= 500:
            raise BackendUnavailable(
                f"Vault answered HTTP {status} to {method.upper()} {path} (sealed, standby or overloaded)"
            )
        if status >= 400:
            raw_errors = body.get("errors")
            errors = tuple(str(e) for e in raw_errors) if isinstance(raw_errors, list) else ()
            detail = "; ".join(errors) or "no detail"
            raise VaultRefused(
                f"Vault refused {method.upper()} {path}: HTTP {status}: {detail}", status=status, errors=errors
            )
        data = body.get("data")
        if status == 204 or data is None:
            return {"auth": body["auth"]} if isinstance(body.get("auth"), dict) else {}
        if not isinstance(data, dict):
            raise BackendUnavailable(f"Vault sent a malformed answer to {method.upper()} {path}")
        return data

    # -- transit ---------------------------------------------------------------------------

    def read_key(self, mount: str, name: str) -> dict[str, Any]:
        """``GET {mount}/keys/{name}``: the key's policy (type, derived, versions, min versions)."""
        return self.request("get", _path(mount, "keys", name))

    def rotate_key(self, mount: str, name: str) -> int:
        """``POST {mount}/keys/{name}/rotate``; returns the new ``latest_version`` (never retried once sent)."""
        self.request("post", _path(mount, "keys", name) + "/rotate", {}, idempotent=False)
        return latest_version(self.read_key(mount, name))

    def configure_key(self, mount: str, name: str, **config: Any) -> dict[str, Any]:
        """``POST {mount}/keys/{name}/config`` with e.g. ``min_decryption_version``."""
        return self.request("post", _path(mount, "keys", name) + "/config", config)

    def encrypt(self, mount: str, name: str, *, plaintext_b64: str, context_b64: str, key_version: int) -> str:
        """``POST {mount}/encrypt/{name}``; returns the ``vault:vN:...`` ciphertext.

        Raises:
            VaultRefused: e.g. `key_version` below ``min_encryption_version``.
            BackendUnavailable: unreachable, 5xx, or no ``ciphertext`` in the answer.
        """
        data = self.request(
            "post",
            _path(mount, "encrypt", name),
            {"plaintext": plaintext_b64, "context": context_b64, "key_version": key_version},
        )
        ciphertext = data.get("ciphertext")
        if not isinstance(ciphertext, str):
            raise BackendUnavailable(f"Vault's answer to encrypt/{name} has no ciphertext")
        return ciphertext

    def decrypt(self, mount: str, name: str, *, ciphertext: str, context_b64: str) -> str:
        """``POST {mount}/decrypt/{name}``; returns the standard-base64 ``plaintext``.

        Raises:
            VaultRefused: Vault rejects the ciphertext (wrong context, corrupted, version too old).
            BackendUnavailable: unreachable, 5xx, or no ``plaintext`` field (an error, not empty bytes).
        """
        data = self.request("post", _path(mount, "decrypt", name), {"ciphertext": ciphertext, "context": context_b64})
        plaintext = data.get("plaintext")
        if not isinstance(plaintext, str):
            raise BackendUnavailable(f"Vault's answer to decrypt/{name} has no plaintext field")
        return plaintext

    def datakey_wrapped(self, mount: str, name: str, *, context_b64: str, key_version: int) -> str:
        """``POST {mount}/datakey/wrapped/{name}`` (256 bits); returns the wrapped key ``vault:vN:...``."""
        data = self.request(
            "post",
            _path(mount, "datakey", "wrapped", name),
            {"context": context_b64, "key_version": key_version, "bits": 256},
        )
        ciphertext = data.get("ciphertext")
        if not isinstance(ciphertext, str):
            raise BackendUnavailable(f"Vault's answer to datakey/wrapped/{name} has no ciphertext")
        return ciphertext

    def with_settings(self, **changes: Any) -> VaultClient:
        """A new client with some settings changed (e.g. a shorter timeout)."""
        return VaultClient(replace(self.settings, **changes))


def latest_version(key_info: Mapping[str, Any]) -> int:
    """The ``latest_version`` of a transit key read, as a positive int (raises `BackendUnavailable` if absent)."""
    version = key_info.get("latest_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise BackendUnavailable("Vault's key read has no latest_version")
    return version


def _path(mount: str, *parts: str) -> str:
    return "/".join([mount.strip("/"), *(quote(p, safe="") for p in parts)])


def _never_connected(exc: Exception) -> bool:
    """True if a ConnectionError happened before the request could reach the server (refused, DNS)."""
    text = repr(exc)
    return "NewConnectionError" in text or "Connection refused" in text or "NameResolutionError" in text
