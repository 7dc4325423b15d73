"""``s3://BUCKET/PREFIX`` as an archive destination (boto3, the standard AWS chain), with S3 Object Lock.

Retention (AWS, "Locking objects with Object Lock",
https://docs.aws.amazon.com/AmazonS3/latest/userguide/object-lock.html):

* ``--retain-days N``: every object written gets ``ObjectLockMode`` (``--retain-mode``, else the
  bucket's default rule's mode, else ``GOVERNANCE``) and ``ObjectLockRetainUntilDate`` = now + N days.
  The bucket must have Object Lock enabled (a one-line error otherwise).
* no ``--retain-days``: nothing is set per object; S3 itself applies the bucket's default retention
  (if it has one) to every new object version. The command says which applied.

Object Lock protects object *versions*: a locked segment can be shadowed by a newer version or a
delete marker, which ``audit verify --from-archive`` reports (its SHA-256 no longer matches, or the
segment is missing); the locked version stays in the bucket to recover from.

Every call has a deadline (`CONNECT_TIMEOUT`, `READ_TIMEOUT`) and standard retries (`MAX_ATTEMPTS`);
all writes are idempotent puts of new names.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from mrtr_keys.errors import AuditError, AuditUnavailable, ConfigError

CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 60.0
"""Seconds a socket read may wait (a segment upload of a few MB on a slow link included)."""
MAX_ATTEMPTS = 3
_OUTAGE_CODES = ("SlowDown", "ServiceUnavailable", "RequestTimeout", "InternalError", "RequestTimeTooSkewed")
"""S3 error codes of a service that cannot answer now (with any 5xx: `AuditUnavailable`, exit 75)."""
MODES = ("GOVERNANCE", "COMPLIANCE")

_BUCKET = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")
"""The bucket names botocore lets through (its ParamValidationError otherwise; an ARN is checked by botocore)."""


class S3Destination:
    """``s3://BUCKET[/PREFIX]``: objects ``PREFIX/NAME``. See the module docstring for retention."""

    def __init__(
        self,
        uri: str,
        *,
        retain_days: float | None = None,
        retain_mode: str | None = None,
        deadlines: tuple[float, float, int] = (CONNECT_TIMEOUT, READ_TIMEOUT, MAX_ATTEMPTS),
    ) -> None:
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise ConfigError(f"archive location {uri!r}: no bucket (use s3://BUCKET/PREFIX)")
        if not (_BUCKET.fullmatch(bucket) or bucket.startswith("arn:")):  # botocore's own check, at the first call
            raise ConfigError(f"s3 location {uri!r}: {bucket!r} is not a bucket name (letters, digits, '.', '-', '_')")
        if retain_days is not None and not retain_days > 0:
            raise ConfigError("--retain-days must be a positive number of days")
        if retain_mode is not None:
            retain_mode = retain_mode.upper()
            if retain_mode not in MODES:
                raise ConfigError(f"--retain-mode must be one of {', '.join(MODES)}")
            if retain_days is None:
                raise ConfigError("--retain-mode needs --retain-days")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.retain_days = retain_days
        self.retain_mode = retain_mode
        self._uri = uri
        self._deadlines = deadlines
        """(connect timeout s, read timeout s, attempts) of every call."""
        self._client: Any = None
        self._lock: dict[str, Any] | None = None  # Object Lock configuration, read once per write run
        self._described = ""

    @property
    def uri(self) -> str:
        return self._uri

    def __repr__(self) -> str:
        return f"S3Destination({self._uri!r})"

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def client(self) -> Any:
        if self._client is None:
            try:
                import boto3
                from botocore.config import Config
            except ImportError:  # pragma: no cover - installed with the kms / all extras
                raise ConfigError("an s3:// archive needs boto3: pip install 'mrtr-keys[kms]'") from None
            connect, read, attempts = self._deadlines
            config = Config(
                connect_timeout=connect, read_timeout=read, retries={"mode": "standard", "total_max_attempts": attempts}
            )
            self._client = boto3.session.Session().client("s3", config=config)
        return self._client

    def _call(self, what: str, op: str, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client(), op)(Bucket=self.bucket, **kw)
        except ClientError as exc:
            err = exc.response.get("Error", {})
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            error = AuditUnavailable if status >= 500 or err.get("Code") in _OUTAGE_CODES else AuditError
            raise error(f"cannot {what} s3://{self.bucket}: {err.get('Code')}: {err.get('Message')}") from None
        except BotoCoreError as exc:  # no answer: refused, cut, timed out, a name that does not resolve
            raise AuditUnavailable(f"cannot {what} s3://{self.bucket}: {type(exc).__name__}: {exc}") from None

    def _lock_configuration(self) -> dict[str, Any]:
        from botocore.exceptions import ClientError

        try:
            doc = self.client().get_object_lock_configuration(Bucket=self.bucket)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code == "ObjectLockConfigurationNotFoundError":
                return {}
            raise AuditError(f"cannot read the Object Lock configuration of s3://{self.bucket}: {code}") from None
        conf: dict[str, Any] = doc.get("ObjectLockConfiguration") or {}
        return conf if conf.get("ObjectLockEnabled") == "Enabled" else {}

    def staging(self) -> Path:
        lock = self._lock = self._lock_configuration()
        default = (lock.get("Rule") or {}).get("DefaultRetention") or {}
        if self.retain_days is not None:
            if not lock:
                raise ConfigError(
                    f"--retain-days: the bucket {self.bucket} does not have Object Lock enabled "
                    "(it can only be enabled on a bucket made with it, or by AWS support)"
                )
            self.retain_mode = self.retain_mode or default.get("Mode") or "GOVERNANCE"
            self._described = f"Object Lock {self.retain_mode}, {self.retain_days:g} day(s) per object (--retain-days)"
        elif default:
            span = f"{default['Days']} day(s)" if "Days" in default else f"{default.get('Years')} year(s)"
            self._described = f"Object Lock {default.get('Mode')}, {span} (the bucket's default retention)"
        elif lock:
            self._described = (
                "none: the bucket has Object Lock but no default retention; pass --retain-days to lock the objects"
            )
        else:
            self._described = "none: the bucket does not have Object Lock"
        return Path(tempfile.mkdtemp(prefix="mrtr-keys-archive-"))

    def cleanup(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def _put(self, name: str, body: Any) -> None:
        extra: dict[str, Any] = {}
        if self.retain_days is not None:
            until = datetime.now(UTC) + timedelta(days=self.retain_days)
            extra = {"ObjectLockMode": self.retain_mode, "ObjectLockRetainUntilDate": until}
        self._call(f"write {self._key(name)} in", "put_object", Key=self._key(name), Body=body,
                   ChecksumAlgorithm="SHA256", **extra)  # fmt: skip

    def put_file(self, name: str, path: Path) -> None:
        with path.open("rb") as f:
            self._put(name, f)

    def put_bytes(self, name: str, data: bytes) -> None:
        self._put(name, data)

    def get(self, name: str, max_bytes: int | None = None) -> bytes | None:
        from botocore.exceptions import ClientError

        kw: dict[str, Any] = {"Key": self._key(name)}
        if max_bytes is not None:
            kw["Range"] = f"bytes=0-{max_bytes}"  # RFC 9110 14.1.2: first max_bytes + 1 bytes
        try:
            obj = self.client().get_object(Bucket=self.bucket, **kw)
            return bytes(obj["Body"].read())
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":  # an empty object
                return b""
        return bytes(self._call(f"read {self._key(name)} in", "get_object", **kw)["Body"].read())

    def list(self, prefix: str) -> list[str]:
        names: list[str] = []
        token: str | None = None
        strip = len(self.prefix) + 1 if self.prefix else 0
        started = time.monotonic()
        while True:
            kw: dict[str, Any] = {"Prefix": self._key(prefix)}
            if token:
                kw["ContinuationToken"] = token
            page = self._call("list", "list_objects_v2", **kw)
            names += [str(o["Key"])[strip:] for o in page.get("Contents", [])]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return sorted(names)
            if time.monotonic() - started > 10 * READ_TIMEOUT:
                raise AuditUnavailable(f"cannot list s3://{self.bucket}/{self._key(prefix)}: too slow")

    def retention(self) -> str:
        return self._described or "unknown (nothing written)"
