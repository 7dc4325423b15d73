"""KMS unreachable, slow or unconfigured: a clear error naming the kid and the cause, fast.

The codec unwraps at construction, so an unreachable KMS fails the construction (bounded by the
configured connect/read timeouts and attempts, docs/kms.md) instead of failing every token later.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from mrtr_keys.changes.create import create_ring
from mrtr_keys.codecs.kms import KMSEnvelopeCodec
from mrtr_keys.errors import BackendUnavailable, ConfigError
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.providers.kms.client import KMSSettings
from mrtr_keys.ring.model import CodecSpec
from tests.fixtures.common import run_cli
from tests.fixtures.moto_kms import KMSEnv, aws_env
from tests.support.proxy import CountingProxy


def test_kms_server_stopped_before_load(
    kms: KMSEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    proxy = CountingProxy(int(kms.moto_url.rsplit(":", 1)[1]))  # a KMS endpoint of its own, to take down
    url = proxy.url
    env = aws_env(url)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    import boto3

    arn = boto3.client("kms").create_key()["KeyMetadata"]["Arn"]
    path = tmp_path / "keyring.json"
    create_ring(FileKeystore(path), codec=CodecSpec("kms", {"kms_key_id": arn}))
    kid = FileKeystore(path).load().primary.kid
    proxy.stop()  # refused from now on (the port stays reserved)
    request.addfinalizer(proxy.close)

    with pytest.raises(BackendUnavailable) as info:
        KMSEnvelopeCodec(path, audience="svc", settings=KMSSettings(connect_timeout=1, read_timeout=1, max_attempts=2))
    assert str(info.value) == f"key {kid}: cannot unwrap: KMS unreachable at {url} (EndpointConnectionError)"

    # The CLI says the same in one line (exit 1), e.g. when a rotation step needs a new data key.
    result = run_cli("rotate", "begin", keystore=path, env={**env, "MRTR_KEYS_KMS_MAX_ATTEMPTS": "1"})
    assert result.code == 1
    assert "KMS GenerateDataKey failed: KMS unreachable at" in result.err
    assert "EndpointConnectionError" in result.err and "Traceback" not in result.err


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A loopback port that accepts connections and never answers (a hung KMS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_hung_kms_fails_at_the_read_timeout(
    kms: KMSEnv, tmp_path: Path, black_hole: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keyring.json"
    create_ring(FileKeystore(path), codec=CodecSpec("kms", {"kms_key_id": kms.create_key()}))
    kid = FileKeystore(path).load().primary.kid
    monkeypatch.setenv("AWS_ENDPOINT_URL", black_hole)
    with pytest.raises(BackendUnavailable) as info:
        KMSEnvelopeCodec(path, audience="svc", settings=KMSSettings(read_timeout=0.3, max_attempts=1))
    assert str(info.value) == f"key {kid}: cannot unwrap: KMS unreachable at {black_hole} (ReadTimeoutError)"


def test_no_credentials_is_a_configuration_error(kms: KMSEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keyring.json"
    create_ring(FileKeystore(path), codec=CodecSpec("kms", {"kms_key_id": kms.create_key()}))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    kms.proxy.reset()
    with pytest.raises(ConfigError, match="NoCredentialsError"):
        KMSEnvelopeCodec(path, audience="svc")
    assert kms.proxy.count == 0


def test_bad_timeout_setting_is_refused(kms: KMSEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MRTR_KEYS_KMS_READ_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="MRTR_KEYS_KMS_READ_TIMEOUT must be a number of seconds"):
        KMSSettings.from_env()
    with pytest.raises(ConfigError, match="max_attempts must be an integer >= 1"):
        KMSSettings(max_attempts=0)
