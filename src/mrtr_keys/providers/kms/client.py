"""AWS KMS client construction for the envelope codec: settings, timeouts and retries, and a guard on
botocore's debug logs. The calls are `mrtr_keys.providers.kms.service.KMSService`; what a ring stores is
`mrtr_keys.providers.kms.wrapped`.

* **Client**: ``boto3.session.Session().client("kms", config=...)``. Region, credentials
  and endpoint come from the standard AWS chain (environment variables including
  ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_KMS``, ``AWS_PROFILE``, the shared config and
  credentials files, container and instance roles); see the AWS SDKs and Tools reference
  guide, "Standardized configuration".
* **Timeouts** (seconds): connect `DEFAULT_CONNECT_TIMEOUT`, read `DEFAULT_READ_TIMEOUT`;
  override with ``MRTR_KEYS_KMS_CONNECT_TIMEOUT`` / ``MRTR_KEYS_KMS_READ_TIMEOUT`` or the
  `KMSSettings` fields.
* **Retries**: botocore's ``standard`` retry mode with ``max_attempts`` =
  `DEFAULT_MAX_ATTEMPTS` (``MRTR_KEYS_KMS_MAX_ATTEMPTS``), which retries only throttling
  errors, transport errors (connection refused/reset, timeouts) and 5xx answers, with
  jittered exponential backoff; never an access-denied or invalid-ciphertext answer.
  Our settings take precedence over ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE``.

Worst case for one unreachable call: ``max_attempts * (connect + read timeout)`` plus the
backoff (< 1 s before the one retry); with the defaults (2 s, 3 s, 2 attempts) about 11 s,
and a refused connection fails in about a second.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mrtr_keys.errors import ConfigError

if TYPE_CHECKING:
    from mypy_boto3_kms import KMSClient

DEFAULT_CONNECT_TIMEOUT = 2.0
DEFAULT_READ_TIMEOUT = 3.0
DEFAULT_MAX_ATTEMPTS = 2
"""One retry: enough for a throttled or dropped request, short enough to fail fast."""

ENV_CONNECT_TIMEOUT = "MRTR_KEYS_KMS_CONNECT_TIMEOUT"
ENV_READ_TIMEOUT = "MRTR_KEYS_KMS_READ_TIMEOUT"
ENV_MAX_ATTEMPTS = "MRTR_KEYS_KMS_MAX_ATTEMPTS"
ENV_KMS_KEY_ID = "MRTR_KEYS_KMS_KEY_ID"
"""Optional pin: the only KMS key (ARN or key id) this process accepts a ring's data keys from."""


@dataclass(frozen=True, slots=True)
class KMSSettings:
    """Client settings; `from_env` fills what is not given. Timeouts in seconds."""

    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT
    max_attempts: int = DEFAULT_MAX_ATTEMPTS

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and value > 0)
            ):
                raise ConfigError(f"kms {name} must be a positive number of seconds")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigError("kms max_attempts must be an integer >= 1 (1 means no retry)")

    @classmethod
    def from_env(
        cls,
        *,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        max_attempts: int | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> KMSSettings:
        """Arguments first, then ``MRTR_KEYS_KMS_*`` environment variables, then the defaults.

        Raises:
            ConfigError: a value is not a positive number (or an integer >= 1 for attempts).
        """
        env = os.environ if environ is None else environ

        def number(value: float | None, var: str, default: float) -> float:
            if value is not None:
                return value
            text = env.get(var)
            if not text:
                return default
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"{var} must be a number of seconds") from None

        attempts: int = DEFAULT_MAX_ATTEMPTS
        if max_attempts is not None:
            attempts = max_attempts
        elif env.get(ENV_MAX_ATTEMPTS):
            try:
                attempts = int(env[ENV_MAX_ATTEMPTS])
            except ValueError:
                raise ConfigError(f"{ENV_MAX_ATTEMPTS} must be an integer >= 1") from None
        return cls(
            connect_timeout=number(connect_timeout, ENV_CONNECT_TIMEOUT, DEFAULT_CONNECT_TIMEOUT),
            read_timeout=number(read_timeout, ENV_READ_TIMEOUT, DEFAULT_READ_TIMEOUT),
            max_attempts=attempts,
        )


class _DropPlaintextBodies(logging.Filter):
    """Drops botocore DEBUG records that carry a KMS ``Plaintext`` field (botocore logs whole
    response bodies at DEBUG, which for Decrypt and GenerateDataKey is the data key)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return "Plaintext" not in record.getMessage()
        except Exception:  # a record that cannot be formatted is not ours to judge
            return True


_PLAINTEXT_FILTER = _DropPlaintextBodies()
_BODY_LOGGERS = ("botocore.parsers", "botocore.endpoint", "botocore.httpchecksum", "botocore.hooks")


def _guard_debug_logs() -> None:
    """Install `_DropPlaintextBodies` on the botocore loggers that print request/response bodies (idempotent)."""
    for name in _BODY_LOGGERS:
        logger = logging.getLogger(name)
        if _PLAINTEXT_FILTER not in logger.filters:
            logger.addFilter(_PLAINTEXT_FILTER)


_MAX_CLIENTS = 16
_clients: dict[tuple[object, ...], Any] = {}
_clients_lock = threading.Lock()


def make_client(settings: KMSSettings | None = None) -> KMSClient:
    """A boto3 KMS client from the standard AWS chain, with `settings` timeouts and retries.

    Clients are thread-safe and costly to build (about 0.1-0.4 s of model loading), so one is
    kept per process for each combination of `settings` and ``AWS_*`` environment variables;
    a changed environment gets a new client. No request is sent here (credentials resolve lazily).

    Raises:
        ConfigError: boto3 is not installed (``pip install 'mrtr-keys[kms]'``), or the AWS
            configuration is unusable (e.g. a named profile that does not exist).
    """
    settings = settings or KMSSettings.from_env()
    cache_key = (settings, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    with _clients_lock:
        cached = _clients.get(cache_key)
        if cached is not None:
            client: KMSClient = cached
            return client
        _guard_debug_logs()
        client = _new_client(settings)
        if len(_clients) >= _MAX_CLIENTS:  # a process whose AWS environment keeps changing
            _clients.clear()
        _clients[cache_key] = client
        return client


def _new_client(settings: KMSSettings) -> KMSClient:
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError
    except ImportError:  # pragma: no cover - the kms extra is installed in dev
        raise ConfigError("the kms codec needs boto3: pip install 'mrtr-keys[kms]'") from None
    config = Config(
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        retries={"mode": "standard", "total_max_attempts": settings.max_attempts},
    )
    try:
        client: KMSClient = boto3.session.Session().client("kms", config=config)
    except BotoCoreError as exc:
        raise ConfigError(f"cannot configure the AWS KMS client: {type(exc).__name__}: {exc}") from None
    return client
