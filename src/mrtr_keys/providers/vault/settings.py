"""Where and how to reach Vault / OpenBao: `VaultSettings`, read from the standard environment.

Settings come from the environment (`VaultSettings.from_env`), never from the key ring:
``VAULT_ADDR`` / ``BAO_ADDR``, ``VAULT_TOKEN`` / ``BAO_TOKEN``, ``VAULT_NAMESPACE`` / ``BAO_NAMESPACE``,
``VAULT_CACERT`` / ``BAO_CACERT`` (a CA bundle file or directory), ``VAULT_CLIENT_CERT`` +
``VAULT_CLIENT_KEY`` (mutual TLS), ``VAULT_SKIP_VERIFY``, ``VAULT_CLIENT_TIMEOUT`` (seconds) and
``VAULT_MAX_RETRIES``, with the same meaning as in the Vault and OpenBao CLIs (the ``VAULT_`` name wins
when both are set). The login settings (AppRole, Kubernetes) are described in
`mrtr_keys.providers.vault.login`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mrtr_keys.errors import ConfigError

DEFAULT_TIMEOUT_SECONDS = 10.0
DEFAULT_MAX_RETRIES = 2
DEFAULT_K8S_TOKEN_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/token"  # noqa: S105 (a path)
"""Where the kubelet mounts a pod's service-account token (unless automounting is off)."""

_TRUE = {"1", "true", "yes", "on"}


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
        try:
            parts = urlsplit(self.addr)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number from 0 to 65535
        except ValueError as exc:  # "http://[::1": an unclosed IPv6 host
            raise ConfigError(
                f"Vault address {self.addr!r} cannot be read: {exc} (set VAULT_ADDR or BAO_ADDR)"
            ) from None
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
