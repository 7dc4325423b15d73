"""A key ring in an AWS Secrets Manager secret: ``aws-sm://NAME`` (a name or a full secret ARN).

The secret's ``SecretString`` is the ring's JSON document. Every write is a new version:
``PutSecretValue`` with the staging label `PENDING_STAGE` only (so it is not current yet), then
``UpdateSecretVersionStage(VersionStage="AWSCURRENT", MoveToVersionId=new,
RemoveFromVersionId=read)``, which Secrets Manager refuses when ``AWSCURRENT`` is no longer on the
version this writer read: that is the compare-and-swap. Moving ``AWSCURRENT`` makes Secrets Manager
put ``AWSPREVIOUS`` on the version it left, so the previous ring stays one call away
(``aws secretsmanager get-secret-value --version-stage AWSPREVIOUS``). A version that lost its race
keeps no label and is deleted by Secrets Manager in time. API: AWS Secrets Manager API Reference,
``PutSecretValue`` and ``UpdateSecretVersionStage``.

`revision()` is ``DescribeSecret``'s ``AWSCURRENT`` version id (no secret value is read). The
client is boto3's, from the standard AWS chain (``AWS_REGION``, ``AWS_PROFILE``, roles,
``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_SECRETS_MANAGER``), with the KMS codec's timeouts and
retry policy (``MRTR_KEYS_KMS_*``). IAM actions: docs/keystores.md.
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from typing import Any, NoReturn

from mrtr_keys.errors import (
    ConfigError,
    KeyRingExists,
    KeyRingNotFound,
    KeystoreError,
    KeystoreUnavailable,
    MrtrKeysError,
)
from mrtr_keys.keystores.remote import RemoteKeystore
from mrtr_keys.providers.kms.client import KMSSettings
from mrtr_keys.ring.model import KeyRing

CURRENT = "AWSCURRENT"
PENDING_STAGE = "MRTR_PENDING"
"""Label on a version between its `PutSecretValue` and the move of ``AWSCURRENT`` onto it."""
_NAME = re.compile(r"[A-Za-z0-9/_+=.@:-]{1,2048}")
_UNAVAILABLE = frozenset(
    {"ThrottlingException", "InternalServiceError", "InternalFailure", "ServiceUnavailable", "RequestTimeout"}
)
_LOST_RACE = frozenset({"InvalidParameterException", "InvalidRequestException"})
"""What ``UpdateSecretVersionStage`` answers when ``AWSCURRENT`` is no longer on ``RemoveFromVersionId``."""
_clients: dict[tuple[object, ...], Any] = {}
_clients_lock = threading.Lock()


def make_client() -> Any:
    """A boto3 ``secretsmanager`` client (one per process and ``AWS_*`` environment), with the KMS
    codec's timeouts and retries (`mrtr_keys.providers.kms.client.KMSSettings`).

    Raises:
        ConfigError: boto3 is not installed (``pip install 'mrtr-keys[kms]'``) or the AWS
            configuration is unusable.
    """
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError
    except ImportError:  # pragma: no cover - installed with the kms extra
        raise ConfigError("the aws-sm keystore needs boto3: pip install 'mrtr-keys[kms]'") from None

    settings = KMSSettings.from_env()
    key = (settings, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            config = Config(
                connect_timeout=settings.connect_timeout,
                read_timeout=settings.read_timeout,
                retries={"mode": "standard", "total_max_attempts": settings.max_attempts},
            )
            try:
                client = boto3.session.Session().client("secretsmanager", config=config)
            except BotoCoreError as exc:
                raise ConfigError(f"cannot configure the AWS Secrets Manager client: {type(exc).__name__}") from None
            if len(_clients) >= 16:
                _clients.clear()
            _clients[key] = client
        return client


class SecretsManagerKeystore(RemoteKeystore):
    """The key ring in Secrets Manager secret `name` (a name or an ARN).

    Args:
        client: a boto3 ``secretsmanager`` client (default: `make_client()`, on first use).
        state_dir: see `mrtr_keys.keystores.state`.
    """

    def __init__(self, name: str, *, client: Any = None, state_dir: str | os.PathLike[str] | None = None) -> None:
        if _NAME.fullmatch(name) is None:
            raise ConfigError("an aws-sm keystore URL names a secret: aws-sm://NAME or aws-sm://ARN")
        super().__init__(state_dir=state_dir)
        self.name = name
        self.url = f"aws-sm://{name}"
        self._client = client

    @classmethod
    def from_url(cls, url: str, *, state_dir: str | os.PathLike[str] | None = None) -> SecretsManagerKeystore:
        """Open ``aws-sm://NAME`` or ``aws-sm://arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME-XXXXXX``."""
        return cls(url.split("://", 1)[1], state_dir=state_dir)

    def __repr__(self) -> str:
        return f"SecretsManagerKeystore({self.url!r})"

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_client()
        return self._client

    def exists(self) -> bool:
        return self._read() is not None

    def revision(self) -> str | None:
        """``DescribeSecret``'s ``AWSCURRENT`` version id; None when the secret or its value is missing."""
        return self._current_id(self._describe())

    def load(self) -> KeyRing:
        found = self._read()
        if found is None:
            raise KeyRingNotFound(f"no key ring at {self.url} (create one with: mrtr-keys init --keystore {self.url})")
        return found[0]

    def create(self, ring: KeyRing) -> None:
        exists = KeyRingExists(f"a key ring already exists at {self.url}; it is never overwritten")
        with self.locked():
            text = ring.dumps().decode("utf-8")
            token = str(uuid.uuid4())
            try:
                self.client.create_secret(Name=self.name, SecretString=text, ClientRequestToken=token)
                self._remember(ring, token)
                return
            except Exception as exc:
                if _code(exc) != "ResourceExistsException":
                    self._fail(exc, "CreateSecret")
            # The secret exists (made by infrastructure code, say): fill it only if it has no value yet.
            if self._current_id(self._describe()) is not None:
                raise exists
            self._call("PutSecretValue", SecretId=self.name, SecretString=text, ClientRequestToken=token)
            if self._current_id(self._describe()) != token:  # the first version is made current; another won
                raise exists
            self._remember(ring, token)

    def save(self, ring: KeyRing, *, expected_generation: int) -> None:
        with self.locked():
            expected_id = self._version_for(ring, expected_generation)
            new_id = str(uuid.uuid4())
            self._call(
                "PutSecretValue",
                SecretId=self.name,
                SecretString=ring.dumps().decode("utf-8"),
                ClientRequestToken=new_id,
                VersionStages=[PENDING_STAGE],
            )
            try:
                self.client.update_secret_version_stage(
                    SecretId=self.name, VersionStage=CURRENT, MoveToVersionId=new_id, RemoveFromVersionId=expected_id
                )
            except Exception as exc:
                code = _code(exc)
                if (
                    code not in ("InvalidParameterException", "InvalidRequestException", None)
                    and code not in _UNAVAILABLE
                ):
                    self._fail(exc, "UpdateSecretVersionStage")
                # Refused (another writer moved AWSCURRENT first) or an unknown outcome: look.
                current = self._current_id(self._describe())
                if current != new_id:
                    found = self._read()
                    raise self._conflict(expected_generation, None if found is None else found[0].generation) from None
            self._remember(ring, new_id)

    # -- internals ---------------------------------------------------------------------------

    def _read(self) -> tuple[KeyRing, str] | None:
        """The ``AWSCURRENT`` ring and its version id; None when there is none.

        "Not found" is asked again twice, 20 ms apart, before it counts: the lasting case (a
        secret that does not exist or was created empty) costs 40 ms once, while a stage label
        seen in passage (emulators such as moto move it in two steps) is never taken for "no ring".
        """
        for attempt in range(3):
            try:
                answer = self.client.get_secret_value(SecretId=self.name, VersionStage=CURRENT)
                break
            except Exception as exc:
                if _code(exc) != "ResourceNotFoundException":
                    self._fail(exc, "GetSecretValue")
                if attempt == 2:
                    return None
                time.sleep(0.02)
        text, version = answer.get("SecretString"), answer.get("VersionId")
        if not isinstance(text, str) or not isinstance(version, str):
            raise KeystoreError(f"the secret at {self.url} holds no key ring (SecretString is empty)")
        ring = self._parse(text.encode("utf-8"))
        self._remember(ring, version)
        return ring, version

    def _current_version(self) -> tuple[int, str] | None:
        found = self._read()
        return None if found is None else (found[0].generation, found[1])

    def _describe(self) -> dict[str, Any] | None:
        try:
            answer: dict[str, Any] = self.client.describe_secret(SecretId=self.name)
        except Exception as exc:
            if _code(exc) == "ResourceNotFoundException":
                return None
            self._fail(exc, "DescribeSecret")
        return answer

    @staticmethod
    def _current_id(description: dict[str, Any] | None) -> str | None:
        stages = (description or {}).get("VersionIdsToStages") or {}
        return next((vid for vid, labels in stages.items() if CURRENT in labels), None)

    def _call(self, op: str, **kwargs: Any) -> Any:
        method = re.sub(r"(?<!^)(?=[A-Z])", "_", op).lower()
        try:
            return getattr(self.client, method)(**kwargs)
        except Exception as exc:
            self._fail(exc, op)

    def _fail(self, exc: Exception, op: str) -> NoReturn:
        """Map a botocore error to ours, naming the keystore, the action and the error code."""
        if isinstance(exc, MrtrKeysError):  # already ours: e.g. boto3 missing (the install hint), never re-mapped
            raise exc
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
            NoRegionError,
            PartialCredentialsError,
        )

        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", "Unknown"))
            message = " ".join(str(err.get("Message", "")).split())
            inner = re.search(r"<Message>(.*?)</Message>", message)  # an XML error body botocore did not parse
            message = (inner.group(1) if inner else message)[:200]
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in _UNAVAILABLE or status >= 500:
                raise KeystoreUnavailable(
                    f"key ring {self.url} is unavailable ({op}: {code}); nothing was changed, retry later"
                ) from None
            if code in ("AccessDeniedException", "AccessDenied", "UnrecognizedClientException") or status == 403:
                code = code if not code.isdigit() else "AccessDenied"
                raise KeystoreError(
                    f"key ring {self.url}: permission denied: secretsmanager:{op} ({code}: {message}); "
                    f"the IAM policy must allow secretsmanager:{op} on this secret (docs/keystores.md)"
                ) from None
            raise KeystoreError(f"key ring {self.url}: Secrets Manager refused {op}: {code}: {message}") from None
        if isinstance(exc, NoCredentialsError | PartialCredentialsError | NoRegionError):
            raise ConfigError(
                f"key ring {self.url}: {type(exc).__name__} (set AWS credentials and AWS_REGION, or a profile or role)"
            ) from None
        if isinstance(exc, BotoCoreError):
            raise KeystoreUnavailable(
                f"key ring {self.url} is unreachable ({op}: {type(exc).__name__}); nothing was changed, retry later"
            ) from None
        if isinstance(exc, MrtrKeysError):
            raise exc
        raise KeystoreUnavailable(f"key ring {self.url}: {op} failed ({type(exc).__name__})") from None


def _code(exc: Exception) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        return str(code) if code is not None else None
    return None
