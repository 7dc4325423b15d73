"""The four AWS KMS calls the envelope codec makes (GenerateDataKey, Decrypt, ReEncrypt, DescribeKey),
with one error mapping (`map_error`) and one judgement of a wrapping key (`check_wrapping_key`) that
``init`` and ``rewrap`` share. Client settings: `mrtr_keys.providers.kms.client`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NoReturn

from mrtr_keys.errors import BackendUnavailable, ConfigError, MrtrKeysError, UnwrapError
from mrtr_keys.providers.kms.client import KMSSettings, make_client
from mrtr_keys.providers.kms.wrapped import DATA_KEY_BYTES, WrappedKey, key_arn_matches

if TYPE_CHECKING:
    from mypy_boto3_kms import KMSClient

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
        # the caller's own credentials or clock, not the key: temporary credentials that could not be refreshed
        # (an STS or instance-metadata outage) and a skewed clock. The wrapping key's check must not read them
        # as a revocation (`mrtr_keys.codecs.kek`): the fleet would fail closed on an STS blip.
        "ExpiredToken",
        "ExpiredTokenException",
        "RequestExpired",
        "InvalidSignatureException",
    }
)


def check_wrapping_key(key_id: str, meta: Mapping[str, Any]) -> str:
    """Judge ``DescribeKey``'s ``KeyMetadata`` for a key to wrap data keys under; returns its key ARN.

    The key must be a symmetric encryption key (``KeySpec`` SYMMETRIC_DEFAULT, ``KeyUsage``
    ENCRYPT_DECRYPT) and enabled. An absent ``KeyUsage`` or ``KeySpec`` means the CreateKey
    defaults, ENCRYPT_DECRYPT and SYMMETRIC_DEFAULT (AWS KMS API reference, CreateKey), as some
    KMS-compatible services (moto) answer for keys created without them.

    Raises:
        ConfigError: another kind of key, a disabled key, or no ARN in the answer.
    """
    if meta.get("KeyUsage", "ENCRYPT_DECRYPT") != "ENCRYPT_DECRYPT" or (
        meta.get("KeySpec", "SYMMETRIC_DEFAULT") != "SYMMETRIC_DEFAULT"
    ):
        raise ConfigError(f"KMS key {key_id} is not a symmetric encryption key (SYMMETRIC_DEFAULT, ENCRYPT_DECRYPT)")
    if not meta.get("Enabled", False):
        raise ConfigError(f"KMS key {key_id} is not enabled (state {meta.get('KeyState')})")
    arn = meta.get("Arn")
    if not isinstance(arn, str) or not arn:
        raise ConfigError(f"KMS DescribeKey for {key_id} answered without a key ARN")
    return arn


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
        """``DescribeKey``: the key ARN an id, ARN or alias names, judged by `check_wrapping_key`.

        Raises:
            ConfigError: no such key, not usable for encryption, or access denied.
            BackendUnavailable: KMS unreachable, throttled or 5xx.
        """
        try:
            meta = self.client.describe_key(KeyId=key_id)["KeyMetadata"]
        except Exception as exc:
            self._fail(exc, "DescribeKey", None, refused=ConfigError)
        return check_wrapping_key(key_id, meta)

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
    if isinstance(exc, MrtrKeysError):  # ours already (e.g. ConfigError: boto3 is not installed)
        return exc
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:  # without botocore no call was made: the client could not be built
        return ConfigError("the kms codec needs boto3: pip install 'mrtr-keys[kms]'")
    from botocore.exceptions import (
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
    return BackendUnavailable(f"{subject}: {verb}: {type(exc).__name__}")
