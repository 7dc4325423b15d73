"""Logging in to Vault / OpenBao when there is no static token: AppRole, or a Kubernetes service account.

AppRole is used when there is no token and ``VAULT_ROLE_ID`` + ``VAULT_SECRET_ID`` are set (mount
``VAULT_APPROLE_MOUNT``, default ``approle``). A Kubernetes service-account login is used when there is
neither and ``VAULT_K8S_ROLE`` is set: ``POST auth/MOUNT/login`` with ``{"role", "jwt"}`` (mount
``VAULT_K8S_MOUNT``, default ``kubernetes``; the JWT read from ``VAULT_K8S_TOKEN_FILE``, default the pod's
``/var/run/secrets/kubernetes.io/serviceaccount/token``, again at each login since the kubelet rotates
projected tokens). Vault's Kubernetes auth method and its JWT auth method configured for service-account
tokens take the same login (https://developer.hashicorp.com/vault/api-docs/auth/kubernetes#login,
https://openbao.org/api-docs/auth/jwt/#jwt-login).

A login is renewed at 80 % of its lease, never as a retry of a refused request, with one exception: a
403 to a token logged in for at least `RELOGIN_AFTER_403` seconds ago (revoked, or lost with a restarted
server) drops it, and the client logs in once more and resends (`Login.drop`).
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote

from mrtr_keys.errors import ConfigError
from mrtr_keys.files import read_regular
from mrtr_keys.providers.vault.errors import LoginRefused, VaultRefused
from mrtr_keys.providers.vault.settings import VaultSettings

RELOGIN_AFTER_403 = 5.0
"""Seconds a logged-in token must have been in use before a 403 makes the client log in again
(a token revoked or lost with a restarted server is replaced; a denying policy is not hammered)."""
MAX_JWT_BYTES = 64 * 1024

Post = Callable[[str, Mapping[str, Any]], dict[str, Any]]
"""Sends ``POST path`` with a JSON body and returns the answer (``{"auth": ...}`` for a login);
raises `VaultRefused` on HTTP 4xx."""


class Login:
    """The token a login gave and when it must be renewed; thread-safe.

    Args:
        settings: the client's settings; with a static `token` there is never a login.
        use_token: called (under the login lock) with each new client token.
    """

    def __init__(self, settings: VaultSettings, use_token: Callable[[str], None]) -> None:
        self.settings = settings
        self._use_token = use_token
        self._lock = threading.Lock()
        self._expires: float | None = None
        self._at: float | None = None

    def ensure(self, post: Post) -> None:
        """Log in if there is no static token and no unexpired login (80 % of its lease).

        Raises:
            LoginRefused: Vault refused the login (HTTP 4xx).
            VaultRefused: the login answer has no client token.
            ConfigError: the service-account token file cannot be read.
            BackendUnavailable: whatever `post` raises for an unreachable Vault.
        """
        s = self.settings
        if s.token is not None:
            return
        with self._lock:
            if self._expires is not None and time.monotonic() < self._expires:
                return
            body: dict[str, str | None]
            if s.role_id and s.secret_id:
                kind, mount, body = "AppRole", s.approle_mount, {"role_id": s.role_id, "secret_id": s.secret_id}
            else:
                kind, mount = "Kubernetes", s.k8s_mount
                body = {"role": s.k8s_role, "jwt": read_jwt(s.k8s_token_file)}
            path = f"auth/{quote(mount, safe='/')}/login"
            try:
                answer = post(path, body)
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
            self._use_token(token)
            self._at = time.monotonic()
            self._expires = self._at + ttl * 0.8

    def drop(self) -> bool:
        """Forget a logged-in token older than `RELOGIN_AFTER_403` seconds; True if one was dropped
        (a static VAULT_TOKEN, or a login this recent, is kept: a policy that denies is not retried)."""
        with self._lock:
            if self.settings.token is not None or self._at is None:
                return False
            if time.monotonic() - self._at < RELOGIN_AFTER_403:
                return False
            self._expires = self._at = None
            return True


def read_jwt(path: str) -> str:
    """The service-account JWT in `path` (read at each login: the kubelet rotates projected tokens).

    Raises:
        ConfigError: the file cannot be read, is empty or larger than 64 KiB (its content is never shown).
    """
    try:
        _, raw = read_regular(path, MAX_JWT_BYTES)  # a FIFO must not block the login for ever
        if raw is None:  # a FIFO, device or directory: not read
            raise OSError(errno.EINVAL, "not a regular file")
    except OSError as exc:
        raise ConfigError(
            f"cannot read the service-account token for the Vault Kubernetes login at {path} "
            f"({exc.strerror or type(exc).__name__}); set VAULT_K8S_TOKEN_FILE or mount the token"
        ) from None
    text = raw.decode("ascii", "replace").strip()
    if not text or len(raw) > MAX_JWT_BYTES:
        raise ConfigError(f"the service-account token file {path} is empty or larger than 64 KiB")
    return text
