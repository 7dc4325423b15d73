"""AWS KMS access for the envelope codec: client construction, the encryption context, and the four calls.

Everything that talks to KMS goes through `KMSService`, so timeouts, retries and
error mapping live in one place:

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

Encryption context (AWS KMS Developer Guide, "Encryption context"): every data key of a
ring is bound to ``{"mrtr:ring": ring_id, "mrtr:kid": kid}`` plus
``"mrtr:audiences": ",".join(sorted(scope))`` when the ring has an audience scope, in that
canonical key order (`encryption_context`). KMS authenticates the context with the
wrapped key, so a blob copied to another ring, kid or scope does not unwrap, and IAM
policies can condition ``kms:Decrypt`` on ``kms:EncryptionContext:mrtr:audiences``.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from mrtr_keys.errors import BackendUnavailable, ConfigError, MrtrKeysError, UnwrapError
from mrtr_keys.ring.model import Key, KeyRing

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

CONTEXT_RING = "mrtr:ring"
CONTEXT_KID = "mrtr:kid"
CONTEXT_AUDIENCES = "mrtr:audiences"
AUDIENCE_SEPARATOR = ","

DATA_KEY_BYTES = 32
MAX_BLOB_CHARS = 8192
"""A KMS ciphertext blob is at most 6144 bytes (API reference, CiphertextBlob); base64 of that fits."""

# Error codes that mean "the service, not the request" (retryable, 5xx or throttling).
_UNAVAILABLE_CODES = frozenset(
    {
        "ThrottlingException",
        "Throttling",
        "RequestLimitExceeded",
        "KMSInternalException",
        "DependencyTimeoutException",
        "KeyUnavailableException",
        "InternalFailure",
        "ServiceUnavailable",
        "ServiceUnavailableException",
        "RequestTimeout",
        "RequestTimeoutException",
    }
)


def encryption_context(ring_id: str, kid: str, audiences: Sequence[str]) -> dict[str, str]:
    """The canonical encryption context of one data key (see the module docstring).

    Raises:
        ConfigError: an audience contains the separator ``,`` (it would make the context ambiguous).
    """
    context = {CONTEXT_RING: ring_id, CONTEXT_KID: kid}
    if audiences:
        for a in audiences:
            if AUDIENCE_SEPARATOR in a:
                raise ConfigError(f"audience {a!r} contains ','; the kms codec binds the scope as a comma-joined list")
        context[CONTEXT_AUDIENCES] = AUDIENCE_SEPARATOR.join(sorted(audiences))
    return context


def key_arn_matches(configured: str, returned_arn: str) -> bool:
    """True if `returned_arn` (a key ARN from KMS) is the key `configured` names (a key ARN or bare key id)."""
    if configured == returned_arn:
        return True
    return not configured.startswith(("arn:", "alias/")) and returned_arn.endswith(":key/" + configured)


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


@dataclass(frozen=True, slots=True)
class WrappedKey:
    """A data key as stored in the ring's ``key_data`` (no plaintext)."""

    ciphertext_blob: bytes
    kms_key_arn: str
    context: dict[str, str]

    def to_key_data(self) -> dict[str, Any]:
        """The ``key_data`` object: ``ciphertext_blob`` (standard base64), ``kms_key_arn``,
        ``encryption_context`` (keys in canonical order)."""
        return {
            "ciphertext_blob": base64.b64encode(self.ciphertext_blob).decode("ascii"),
            "kms_key_arn": self.kms_key_arn,
            "encryption_context": dict(self.context),
        }

    @classmethod
    def from_key_data(cls, kid: str, data: Mapping[str, Any]) -> WrappedKey:
        """Parse a key's ``key_data``.

        Raises:
            UnwrapError: a field is missing or malformed (code ``MalformedKeyData``).
        """

        def bad(what: str) -> NoReturn:
            raise UnwrapError(f"key {kid}: cannot unwrap: MalformedKeyData ({what})")

        blob_text = data.get("ciphertext_blob")
        arn = data.get("kms_key_arn")
        context = data.get("encryption_context")
        if not isinstance(blob_text, str) or not blob_text.isascii() or not 0 < len(blob_text) <= MAX_BLOB_CHARS:
            bad("ciphertext_blob must be standard base64 text")
        try:
            blob = base64.b64decode(blob_text, validate=True)
        except (binascii.Error, ValueError):
            bad("ciphertext_blob does not decode as base64")
        if not isinstance(arn, str) or not arn:
            bad("kms_key_arn must be a non-empty string")
        if not isinstance(context, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in context.items()
        ):
            bad("encryption_context must be an object of strings")
        return cls(blob, arn, dict(context))


class KMSService:
    """The four KMS calls the envelope codec makes, with error mapping; never logs or returns secrets
    except the plaintext data key `generate_data_key` / `decrypt` return to their caller.

    Args:
        client: a boto3 KMS client (default: `make_client(settings)`, created on first use).
        settings: timeouts and retries for the default client.
    """

    def __init__(self, client: KMSClient | None = None, settings: KMSSettings | None = None) -> None:
        self._client = client
        self._settings = settings

    @property
    def client(self) -> KMSClient:
        if self._client is None:
            self._client = make_client(self._settings)
        return self._client

    @property
    def endpoint(self) -> str:
        """The endpoint URL requests go to (no secret in it)."""
        return str(self.client.meta.endpoint_url)

    def generate_data_key(self, key_id: str, context: dict[str, str], *, kid: str) -> tuple[bytes, WrappedKey]:
        """``GenerateDataKey`` (KeySpec AES_256): the 32-byte plaintext and the wrapped form.

        Raises:
            BackendUnavailable: KMS unreachable, throttled or 5xx.
            ConfigError: KMS refused (access denied, unknown or disabled key).
        """
        try:
            resp = self.client.generate_data_key(KeyId=key_id, KeySpec="AES_256", EncryptionContext=context)
        except Exception as exc:
            self._fail(exc, "GenerateDataKey", kid, refused=ConfigError)
        plaintext = bytes(resp["Plaintext"])
        if len(plaintext) != DATA_KEY_BYTES:
            raise BackendUnavailable(f"KMS GenerateDataKey for key {kid} returned a data key of the wrong size")
        return plaintext, WrappedKey(bytes(resp["CiphertextBlob"]), str(resp["KeyId"]), dict(context))

    def decrypt(self, wrapped: WrappedKey, key_id: str, *, kid: str) -> bytes:
        """``Decrypt`` with ``KeyId`` = `key_id` and the recorded encryption context; checks the
        returned ``KeyId`` names the same key.

        Raises:
            UnwrapError: KMS refused (``AccessDeniedException``, ``IncorrectKeyException``,
                ``InvalidCiphertextException``, ``DisabledException``, ...), or KMS answered with
                another key (code ``KeyIdMismatch``), or the plaintext is not 32 bytes.
            BackendUnavailable: KMS unreachable, throttled or 5xx.
            ConfigError: no AWS credentials or region.
        """
        try:
            resp = self.client.decrypt(
                CiphertextBlob=wrapped.ciphertext_blob, KeyId=key_id, EncryptionContext=wrapped.context
            )
        except Exception as exc:
            self._fail(exc, "Decrypt", kid, refused=UnwrapError)
        returned = str(resp.get("KeyId", ""))
        if not key_arn_matches(key_id, returned):
            raise UnwrapError(
                f"key {kid}: cannot unwrap: KeyIdMismatch (KMS decrypted it with {returned or 'no key id'}, "
                f"not the configured {key_id})"
            )
        plaintext = bytes(resp["Plaintext"])
        if len(plaintext) != DATA_KEY_BYTES:
            raise UnwrapError(f"key {kid}: cannot unwrap: WrongKeySize (the data key is not {DATA_KEY_BYTES} bytes)")
        return plaintext

    def re_encrypt(
        self, wrapped: WrappedKey, *, source_key_id: str, destination_key_id: str, context: dict[str, str], kid: str
    ) -> WrappedKey:
        """``ReEncrypt`` a wrapped key under `destination_key_id` with the destination `context`;
        the plaintext never leaves KMS. Checks both returned key ids.

        Raises:
            UnwrapError: KMS refused (wrong source key or context, access denied) or answered with
                other keys (``KeyIdMismatch``).
            BackendUnavailable: KMS unreachable, throttled or 5xx.
        """
        try:
            resp = self.client.re_encrypt(
                CiphertextBlob=wrapped.ciphertext_blob,
                SourceKeyId=source_key_id,
                SourceEncryptionContext=wrapped.context,
                DestinationKeyId=destination_key_id,
                DestinationEncryptionContext=context,
            )
        except Exception as exc:
            self._fail(exc, "ReEncrypt", kid, refused=UnwrapError)
        source, dest = str(resp.get("SourceKeyId", "")), str(resp.get("KeyId", ""))
        if not key_arn_matches(source_key_id, source) or not key_arn_matches(destination_key_id, dest):
            raise UnwrapError(f"key {kid}: cannot rewrap: KeyIdMismatch (KMS answered with other keys)")
        return WrappedKey(bytes(resp["CiphertextBlob"]), dest, dict(context))

    def key_arn(self, key_id: str) -> str:
        """``DescribeKey``: the key ARN an id, ARN or alias names (must be an enabled symmetric key).

        Raises:
            ConfigError: no such key, not usable for encryption, or access denied.
            BackendUnavailable: KMS unreachable, throttled or 5xx.
        """
        try:
            meta = self.client.describe_key(KeyId=key_id)["KeyMetadata"]
        except Exception as exc:
            self._fail(exc, "DescribeKey", None, refused=ConfigError)
        if meta.get("KeyUsage") != "ENCRYPT_DECRYPT" or meta.get("KeySpec", "SYMMETRIC_DEFAULT") != "SYMMETRIC_DEFAULT":
            raise ConfigError(
                f"KMS key {key_id} is not a symmetric encryption key (SYMMETRIC_DEFAULT, ENCRYPT_DECRYPT)"
            )
        if not meta.get("Enabled", False):
            raise ConfigError(f"KMS key {key_id} is not enabled (state {meta.get('KeyState')})")
        return str(meta["Arn"])

    def _fail(self, exc: Exception, op: str, kid: str | None, *, refused: type[MrtrKeysError]) -> NoReturn:
        raise map_error(exc, op, kid, endpoint=self._endpoint_or_none(), refused=refused) from None

    def _endpoint_or_none(self) -> str | None:
        try:
            return self.endpoint
        except MrtrKeysError:
            return None


def map_error(
    exc: Exception, op: str, kid: str | None, *, endpoint: str | None, refused: type[MrtrKeysError]
) -> MrtrKeysError:
    """Turn a botocore exception into one of ours, naming the operation, the kid and the KMS error code.

    Throttling, 5xx and transport errors -> `BackendUnavailable`; missing credentials or region ->
    `ConfigError`; any other refusal -> `refused` (`UnwrapError` for Decrypt/ReEncrypt). The KMS
    message is kept (KMS never echoes key material); request parameters are not.
    """
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        HTTPClientError,
        NoCredentialsError,
        NoRegionError,
        ParamValidationError,
        PartialCredentialsError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError

    subject = f"key {kid}" if kid else "the KMS key"
    verb = {"Decrypt": "cannot unwrap", "ReEncrypt": "cannot rewrap"}.get(op, f"KMS {op} failed")
    where = f" at {endpoint}" if endpoint else ""
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", "Unknown"))
        message = str(err.get("Message", "")).strip()[:200]
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        detail = f"{code}: {message}" if message else code
        if code in _UNAVAILABLE_CODES or status >= 500:
            return BackendUnavailable(f"{subject}: {verb}: KMS unavailable{where} ({detail})")
        return refused(f"{subject}: {verb}: {detail}")
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return ConfigError(
            f"{subject}: {verb}: {type(exc).__name__} (no AWS credentials in the standard chain: "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws, or an instance role)"
        )
    if isinstance(exc, NoRegionError):
        return ConfigError(f"{subject}: {verb}: NoRegionError (set AWS_REGION or a profile region)")
    if isinstance(exc, ParamValidationError):
        return ConfigError(f"{subject}: {verb}: ParamValidationError (check the KMS key id and the ring's key_data)")
    if isinstance(exc, BotoConnectionError | HTTPClientError):
        return BackendUnavailable(f"{subject}: {verb}: KMS unreachable{where} ({type(exc).__name__})")
    if isinstance(exc, BotoCoreError):
        return BackendUnavailable(f"{subject}: {verb}: {type(exc).__name__}")
    if isinstance(exc, MrtrKeysError):
        return exc
    return BackendUnavailable(f"{subject}: {verb}: {type(exc).__name__}")


def ring_key_id(ring: KeyRing, pinned: str | None = None) -> str:
    """The KMS key a ring's data keys must be wrapped under: the ring's recorded ``kms_key_id``,
    which must match `pinned` when the process pins one (``MRTR_KEYS_KMS_KEY_ID`` / ``kms_key_id=``).

    Raises:
        ConfigError: the ring records no KMS key.
        UnwrapError: the ring's key is not the pinned one (code ``KeyIdMismatch``).
    """
    recorded = ring.codec.params.get("kms_key_id")
    if not isinstance(recorded, str) or not recorded:
        raise ConfigError(
            f"key ring {ring.ring_id} records no KMS key; create it with: mrtr-keys init --codec kms --kms-key-id ARN"
        )
    if pinned and not key_arn_matches(pinned, recorded):
        raise UnwrapError(
            f"key ring {ring.ring_id}: cannot unwrap: KeyIdMismatch (the ring's data keys are wrapped under "
            f"{recorded}, but this process accepts only {pinned}; see {ENV_KMS_KEY_ID})"
        )
    return recorded


def checked_wrapped_key(ring: KeyRing, key: Key, key_id: str) -> WrappedKey:
    """A key's wrapped data key, after the local checks that come before any KMS call.

    The recorded context must equal `encryption_context` of this ring (ring id, kid, scope)
    exactly, and the recorded key ARN must be `key_id`. The returned `WrappedKey` carries the
    context derived from the ring, never the recorded one, so a blob copied from another ring
    can only be sent to KMS with this ring's context (and fails there).

    Raises:
        UnwrapError: ``PlaintextInRing``, ``MalformedKeyData``, ``EncryptionContextMismatch`` or
            ``KeyIdMismatch``, naming the kid and (for contexts) the names of the differing pairs.
    """
    if key.material is not None:
        raise UnwrapError(f"key {key.kid}: cannot unwrap: PlaintextInRing (a kms key ring must not hold 'material')")
    wrapped = WrappedKey.from_key_data(key.kid, key.key_data)
    expected = encryption_context(ring.ring_id, key.kid, ring.audiences)
    if wrapped.context != expected:
        names = sorted(
            set(expected) ^ set(wrapped.context)
            | {n for n in set(expected) & set(wrapped.context) if expected[n] != wrapped.context[n]}
        )
        raise UnwrapError(
            f"key {key.kid}: cannot unwrap: EncryptionContextMismatch (recorded pairs {', '.join(names)} "
            f"differ from this ring's context; was the ring or the key edited or copied?)"
        )
    if not key_arn_matches(key_id, wrapped.kms_key_arn):
        raise UnwrapError(
            f"key {key.kid}: cannot unwrap: KeyIdMismatch (recorded as wrapped under {wrapped.kms_key_arn}, "
            f"but the ring's KMS key is {key_id}; run: mrtr-keys rewrap --kms-key-id ARN)"
        )
    return WrappedKey(wrapped.ciphertext_blob, wrapped.kms_key_arn, expected)
