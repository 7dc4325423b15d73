"""What the Vault client raises when Vault answers but refuses: a request (`VaultRefused`) or the login
itself (`LoginRefused`). Transport failures and HTTP 5xx are `mrtr_keys.errors.BackendUnavailable`."""

from __future__ import annotations

from mrtr_keys.errors import BackendUnavailable, MrtrKeysError


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
