"""A small, typed client for the HashiCorp Vault / OpenBao transit API, built on hvac.

Settings come from the standard environment (`VaultSettings.from_env`), never
from the key ring: ``VAULT_ADDR`` / ``BAO_ADDR``, ``VAULT_TOKEN`` / ``BAO_TOKEN``,
``VAULT_NAMESPACE`` / ``BAO_NAMESPACE``, ``VAULT_CACERT`` / ``BAO_CACERT`` (a CA
bundle file or directory), ``VAULT_CLIENT_CERT`` + ``VAULT_CLIENT_KEY`` (mutual
TLS), ``VAULT_SKIP_VERIFY``, ``VAULT_CLIENT_TIMEOUT`` (seconds) and
``VAULT_MAX_RETRIES``, with the same meaning as in the Vault and OpenBao CLIs
(the ``VAULT_`` name wins when both are set). AppRole is used when there is no
token and ``VAULT_ROLE_ID`` + ``VAULT_SECRET_ID`` are set (mount
``VAULT_APPROLE_MOUNT``, default ``approle``). A Kubernetes service-account login is
used when there is neither and ``VAULT_K8S_ROLE`` is set: ``POST auth/MOUNT/login``
with ``{"role", "jwt"}`` (mount ``VAULT_K8S_MOUNT``, default ``kubernetes``; the JWT
read from ``VAULT_K8S_TOKEN_FILE``, default the pod's
``/var/run/secrets/kubernetes.io/serviceaccount/token``, again at each login since the
kubelet rotates projected tokens). Vault's Kubernetes auth method and its JWT auth
method configured for service-account tokens take the same login
(https://developer.hashicorp.com/vault/api-docs/auth/kubernetes#login,
https://openbao.org/api-docs/auth/jwt/#jwt-login). A login is renewed before its
lease runs out, never as a retry of a refused request.

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

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote, urlsplit

from mrtr_keys.errors import BackendUnavailable, ConfigError, MrtrKeysError

DEFAULT_TIMEOUT_SECONDS = 10.0
DEFAULT_MAX_RETRIES = 2
RELOGIN_AFTER_403 = 5.0
"""Seconds a logged-in token must have been in use before a 403 makes the client log in again
(a token revoked or lost with a restarted server is replaced; a denying policy is not hammered)."""
DEFAULT_K8S_TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"  # noqa: S105 (a path)
"""Where the kubelet mounts a pod's service-account token (unless automounting is off)."""
MAX_JWT_BYTES = 64 * 1024
RETRY_BACKOFF_SECONDS = 0.05
"""First retry delay (seconds); doubles on each further retry."""

_TRUE = {"1", "true", "yes", "on"}


class VaultRefused(MrtrKeysError):
    """Vault answered a request with HTTP 4xx (permission denied, bad request, no such key).

    `status` is the HTTP status; `errors` Vault's error strings (no secrets in them).
    """

    def __init__(self, message: str, *, status: int, errors: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.errors = errors


class LoginRefused(BackendUnavailable):
    """Vault refused the AppRole or Kubernetes login itself (wrong role, secret, service account or
    audience; an expired or unreadable service-account token), as opposed to a request the logged-in
    token may not make. A `BackendUnavailable`: the instance cannot use Vault, so a token it cannot
    decrypt is never reported as an invalid token. `status` and `errors` as in `VaultRefused`."""

    def __init__(self, message: str, *, status: int, errors: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.errors = errors


def _env(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = env.get(name)
        if value:
            return value
    return None


@dataclass(frozen=True)
class VaultSettings:
    """Where and how to reach Vault. Secrets (`token`, `secret_id`) never appear in `repr()`.

    Attributes:
        addr: base URL, e.g. ``https://vault.example:8200`` (http only for loopback or tests).
        token: a Vault token, or None to use AppRole.
        namespace: Vault Enterprise / OpenBao namespace, sent as ``X-Vault-Namespace``.
        role_id, secret_id, approle_mount: AppRole login, used when `token` is None.
        k8s_role, k8s_mount, k8s_token_file: Kubernetes service-account login (the JWT in
            `k8s_token_file`), used when there is neither a token nor AppRole.
        ca_cert: path of a CA bundle file or directory to verify the server with.
        client_cert, client_key: PEM paths for mutual TLS.
        tls_verify: False only for throwaway test servers (``VAULT_SKIP_VERIFY``).
        timeout: connect and read timeout of one HTTP request (seconds).
        max_retries: extra attempts after a transport error (never after an HTTP answer).
    """

    addr: str
    token: str | None = field(default=None, repr=False)
    namespace: str | None = None
    role_id: str | None = None
    secret_id: str | None = field(default=None, repr=False)
    approle_mount: str = "approle"
    k8s_role: str | None = None
    k8s_mount: str = "kubernetes"
    k8s_token_file: str = DEFAULT_K8S_TOKEN_FILE
    ca_cert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    tls_verify: bool = True
    timeout: float = DEFAULT_TIMEOUT_SECONDS
    max_retries: int = DEFAULT_MAX_RETRIES

    def __post_init__(self) -> None:
        parts = urlsplit(self.addr)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"Vault address {self.addr!r} is not an http(s) URL (set VAULT_ADDR or BAO_ADDR)")
        if not (self.timeout > 0 and self.timeout < 3600):
            raise ConfigError("the Vault client timeout must be between 0 and 3600 seconds")
        if not (0 <= self.max_retries <= 10):
            raise ConfigError("the Vault client retries must be between 0 and 10")
        if self.token is None and not (self.role_id and self.secret_id) and not self.k8s_role:
            raise ConfigError(
                "no Vault credentials: set VAULT_TOKEN (or BAO_TOKEN), VAULT_ROLE_ID and VAULT_SECRET_ID for AppRole, "
                "or VAULT_K8S_ROLE for a Kubernetes service-account login"
            )
        if (self.client_cert is None) != (self.client_key is None):
            raise ConfigError("mutual TLS needs both VAULT_CLIENT_CERT and VAULT_CLIENT_KEY")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> VaultSettings:
        """Settings from the environment (see the module docstring), then `overrides` by field name.

        Raises:
            ConfigError: no address, no credentials, or an unparsable timeout/retry count.
        """
        env = os.environ if env is None else env
        addr = _env(env, "VAULT_ADDR", "BAO_ADDR")
        values: dict[str, Any] = {
            "addr": addr,
            "token": _env(env, "VAULT_TOKEN", "BAO_TOKEN"),
            "namespace": _env(env, "VAULT_NAMESPACE", "BAO_NAMESPACE"),
            "role_id": _env(env, "VAULT_ROLE_ID", "BAO_ROLE_ID"),
            "secret_id": _env(env, "VAULT_SECRET_ID", "BAO_SECRET_ID"),
            "approle_mount": _env(env, "VAULT_APPROLE_MOUNT", "BAO_APPROLE_MOUNT") or "approle",
            "k8s_role": _env(env, "VAULT_K8S_ROLE", "BAO_K8S_ROLE"),
            "k8s_mount": _env(env, "VAULT_K8S_MOUNT", "BAO_K8S_MOUNT") or "kubernetes",
            "k8s_token_file": _env(env, "VAULT_K8S_TOKEN_FILE", "BAO_K8S_TOKEN_FILE") or DEFAULT_K8S_TOKEN_FILE,
            "ca_cert": _env(env, "VAULT_CACERT", "BAO_CACERT", "VAULT_CAPATH", "BAO_CAPATH"),
            "client_cert": _env(env, "VAULT_CLIENT_CERT", "BAO_CLIENT_CERT"),
            "client_key": _env(env, "VAULT_CLIENT_KEY", "BAO_CLIENT_KEY"),
            "tls_verify": (_env(env, "VAULT_SKIP_VERIFY", "BAO_SKIP_VERIFY") or "").lower() not in _TRUE,
        }
        timeout = _env(env, "VAULT_CLIENT_TIMEOUT", "BAO_CLIENT_TIMEOUT")
        retries = _env(env, "VAULT_MAX_RETRIES", "BAO_MAX_RETRIES")
        try:
            values["timeout"] = float(timeout.rstrip("s")) if timeout else DEFAULT_TIMEOUT_SECONDS
            values["max_retries"] = int(retries) if retries else DEFAULT_MAX_RETRIES
        except ValueError:
            raise ConfigError("VAULT_CLIENT_TIMEOUT is seconds and VAULT_MAX_RETRIES an integer") from None
        values.update(overrides)
        if not values["addr"]:
            raise ConfigError("no Vault address: set VAULT_ADDR (or BAO_ADDR for OpenBao)")
        return cls(**values)


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
        self._login_lock = threading.Lock()
        self._login_expires: float | None = None
        self._login_at: float | None = None

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
        self._ensure_login()
        try:
            return self._send(method, path, payload, idempotent=idempotent)
        except VaultRefused as exc:
            if exc.status != 403 or not self._drop_login():
                raise
        # the token this instance logged in for was refused: revoked, or lost by a restarted server.
        # A 403 means the request was not served, so one fresh login and one resend are safe.
        self._ensure_login()
        return self._send(method, path, payload, idempotent=idempotent)

    def _drop_login(self) -> bool:
        """Forget a logged-in token older than `RELOGIN_AFTER_403` seconds; True if one was dropped
        (a static VAULT_TOKEN, or a login this recent, is kept: a policy that denies is not retried)."""
        with self._login_lock:
            if self.settings.token is not None or self._login_at is None:
                return False
            if time.monotonic() - self._login_at < RELOGIN_AFTER_403:
                return False
            self._login_expires = self._login_at = None
            return True

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

    def _ensure_login(self) -> None:
        s = self.settings
        if s.token is not None:
            return
        with self._login_lock:
            if self._login_expires is not None and time.monotonic() < self._login_expires:
                return
            body: dict[str, str | None]
            if s.role_id and s.secret_id:
                kind, mount, body = "AppRole", s.approle_mount, {"role_id": s.role_id, "secret_id": s.secret_id}
            else:
                kind, mount = "Kubernetes", s.k8s_mount
                body = {"role": s.k8s_role, "jwt": _read_jwt(s.k8s_token_file)}
            path = f"auth/{quote(mount, safe='/')}/login"
            try:
                answer = self._send("post", path, body, idempotent=True)
            except VaultRefused as exc:
                detail = "; ".join(exc.errors) or "no detail"
                who = f"role {s.k8s_role!r}, " if kind == "Kubernetes" else ""
                raise LoginRefused(
                    f"Vault refused the {kind} login ({who}POST {path}): HTTP {exc.status}: {detail}",
                    status=exc.status,
                    errors=exc.errors,
                ) from None
            auth = answer.get("auth")
            token = auth.get("client_token") if isinstance(auth, dict) else None
            if not isinstance(token, str) or not token:
                raise VaultRefused(f"Vault {kind} login returned no client token", status=200)
            assert isinstance(auth, dict)
            lease = auth.get("lease_duration")
            ttl = float(lease) if isinstance(lease, int | float) and lease > 0 else 3600.0
            self._hvac.token = token
            self._login_at = time.monotonic()
            self._login_expires = self._login_at + ttl * 0.8

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


def _read_jwt(path: str) -> str:
    """The service-account JWT in `path` (read at each login: the kubelet rotates projected tokens).

    Raises:
        ConfigError: the file cannot be read, is empty or larger than 64 KiB (its content is never shown).
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_JWT_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"cannot read the service-account token for the Vault Kubernetes login at {path} "
            f"({exc.strerror or type(exc).__name__}); set VAULT_K8S_TOKEN_FILE or mount the token"
        ) from None
    text = raw.decode("ascii", "replace").strip()
    if not text or len(raw) > MAX_JWT_BYTES:
        raise ConfigError(f"the service-account token file {path} is empty or larger than 64 KiB")
    return text


def _path(mount: str, *parts: str) -> str:
    return "/".join([mount.strip("/"), *(quote(p, safe="") for p in parts)])


def _never_connected(exc: Exception) -> bool:
    """True if a ConnectionError happened before the request could reach the server (refused, DNS)."""
    text = repr(exc)
    return "NewConnectionError" in text or "Connection refused" in text or "NameResolutionError" in text
