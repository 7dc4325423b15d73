"""The wrapping key's check (`mrtr_keys.codecs.kek`, issue 37): which KMS answers mean "the key is gone or
denied" (fail closed) and which an outage (keep serving), judged on botocore's real error shapes: the errors
botocore itself builds from the KMS service model (its `Stubber` answers through the client's own parser),
and real transport failures (a refused port, a listener that never answers). The KMS ring and its data keys
come from moto in server mode; the codec's check runs in the test's thread (`KekCheck.check`)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.stub import Stubber
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs import kek as kek_module
from mrtr_keys.codecs.kek import OK, REVOKED, UNREACHABLE, WRAPPING_KEY_REVOKED, KekCheck, check_every
from mrtr_keys.codecs.kms import KMSEnvelopeCodec
from mrtr_keys.errors import ConfigError, WrappingKeyRevoked
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.providers.kms.service import KMSService
from mrtr_keys.ring.model import CodecSpec
from tests.fixtures.moto_kms import REGION, KMSEnv

AUD = "svc"
REVOKING = [
    ("DisabledException", 400),
    ("KMSInvalidStateException", 400),  # pending deletion
    ("AccessDeniedException", 400),
    ("NotFoundException", 400),
    ("IncorrectKeyException", 400),
    ("InvalidCiphertextException", 400),
    ("403", 403),  # moto's IAM enforcement answers an explicit Deny this way
]
OUTAGES = [
    ("ThrottlingException", 400),
    ("KMSInternalException", 500),
    ("KeyUnavailableException", 500),
    ("DependencyTimeoutException", 503),
    ("ServiceUnavailableException", 503),
    # the instance's credentials or clock, not the key: an STS outage left them unrefreshed, or the clock drifted
    ("ExpiredTokenException", 400),
    ("RequestExpired", 400),
    ("InvalidSignatureException", 400),
]


@pytest.fixture
def ring(kms: KMSEnv, tmp_path: Path) -> FileKeystore:
    store = FileKeystore(tmp_path / "keyring.json")
    create_ring(store, codec=CodecSpec("kms", {"kms_key_id": kms.create_key()}), audiences=(AUD,))
    run_step(store, "begin")  # two usable keys: serving again unwraps both
    return store


def _client(endpoint: str, **config: Any) -> Any:
    return boto3.session.Session().client(
        "kms",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(retries={"mode": "standard", "total_max_attempts": 1}, **config),
    )


def _stubbed(kms: KMSEnv, ring: FileKeystore) -> tuple[KMSEnvelopeCodec, Stubber, KekCheck, dict[str, bytes]]:
    """A codec whose KMS client answers through botocore's Stubber (its unwraps replay moto's real answers),
    its check (not started), and the data keys by kid."""
    plain = {entry[0]: key for entry, key in KMSEnvelopeCodec(ring, audience=AUD, kek_check_every=0)._unwrapped.items()}
    stubber = Stubber(client := _client(kms.proxy.url))
    stubber.activate()
    _unwraps(stubber, ring, plain, [k.kid for k in ring.load().usable_keys()])
    codec = KMSEnvelopeCodec(ring, audience=AUD, service=KMSService(client), kek_check_every=0)
    stubber.assert_no_pending_responses()
    return codec, stubber, KekCheck(0, what="KMS key (stubbed)").add(codec), plain


def _unwraps(stubber: Stubber, ring: FileKeystore, plain: dict[str, bytes], kids: list[str]) -> None:
    """Queue one successful ``Decrypt`` answer for each of `kids`, in order."""
    arn = str(ring.load().codec.params["kms_key_id"])
    for kid in kids:
        stubber.add_response(
            "decrypt", {"KeyId": arn, "Plaintext": plain[kid], "EncryptionAlgorithm": "SYMMETRIC_DEFAULT"}
        )


def test_each_refusal_fails_closed_and_a_later_answer_serves_again(kms: KMSEnv, ring: FileKeystore) -> None:
    codec, stubber, check, plain = _stubbed(kms, ring)
    usable = [k.kid for k in ring.load().usable_keys()]
    token = codec.seal(b"before")
    for code, status in REVOKING:
        stubber.add_client_error("decrypt", service_error_code=code, http_status_code=status, service_message="no")
        before = kek_module.TOTALS[REVOKED]
        assert check.check() == REVOKED and code in (check.closed or ""), (code, check.status())
        assert kek_module.TOTALS[REVOKED] == before + 1
        assert codec._unwrapped == {}  # the plaintext data keys are dropped
        with pytest.raises(WrappingKeyRevoked, match="sealing refused"):
            codec.seal(b"x")
        with pytest.raises(InvalidRequestState, match=WRAPPING_KEY_REVOKED):
            codec.unseal(token)
        _unwraps(stubber, ring, plain, [usable[0], *usable])  # the check (the primary), then each usable key
        assert check.check() == OK and check.closed is None and check.last_ok is not None, code
        assert codec.unseal(token) == b"before" and codec.unseal(codec.seal(b"after")) == b"after"
    stubber.assert_no_pending_responses()


def test_throttling_and_5xx_are_an_outage_and_the_codec_keeps_serving(kms: KMSEnv, ring: FileKeystore) -> None:
    codec, stubber, check, _ = _stubbed(kms, ring)
    for code, status in OUTAGES:
        stubber.add_client_error("decrypt", service_error_code=code, http_status_code=status)
        assert check.check() == UNREACHABLE and check.closed is None, code
        assert "KMS unavailable" in (check.error or "") and code in (check.error or "")
        assert codec.unseal(codec.seal(b"served")) == b"served"
        assert check.next_delay() <= kek_module.RETRY_UNREACHABLE  # retried soon


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A listener that accepts and never answers (connections held, nothing said)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(5)
    for s in held:
        s.close()
    server.close()


def test_a_refused_or_silent_endpoint_and_no_credentials_are_outages(
    kms: KMSEnv, ring: FileKeystore, silent_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.support.net import refused_port

    codec = KMSEnvelopeCodec(ring, audience=AUD, kek_check_every=0)
    check = KekCheck(0, what="KMS key").add(codec)
    with refused_port() as refused:
        endpoints = (f"http://127.0.0.1:{refused}", f"http://127.0.0.1:{silent_port}")
    for endpoint in endpoints:
        codec._kms = KMSService(_client(endpoint, connect_timeout=0.5, read_timeout=0.5))
        assert check.check() == UNREACHABLE and check.closed is None, endpoint
        assert "KMS unreachable" in (check.error or ""), check.error
        assert codec.unseal(codec.seal(b"served")) == b"served"
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    codec._kms = KMSService(boto3.session.Session().client("kms", endpoint_url=kms.proxy.url, region_name=REGION))
    assert check.check() == UNREACHABLE and "NoCredentialsError" in (check.error or "")


def test_the_interval_comes_from_the_argument_the_environment_or_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kek_module.ENV_EVERY, raising=False)
    assert check_every() == 300.0 and check_every(1) == 1.0 and check_every(0) == 0.0
    monkeypatch.setenv(kek_module.ENV_EVERY, "2.5")
    assert check_every() == 2.5
    for bad in ("soon", "-1", "0.01", "1e9", "nan"):
        monkeypatch.setenv(kek_module.ENV_EVERY, bad)
        with pytest.raises(ConfigError, match=r"0 \(off\)|MRTR_KEYS_KEK_CHECK_EVERY"):
            check_every()


def test_each_wait_is_at_most_one_interval_so_a_revocation_is_seen_within_it() -> None:
    low, high = KekCheck(10, what="k", rng=lambda: 0.0), KekCheck(10, what="k", rng=lambda: 0.999)
    assert low.next_delay() == 8.0 and 9.9 < high.next_delay() <= 10.0


def test_the_codecs_of_one_wrapping_key_share_one_check_and_close_and_open_together(
    kms: KMSEnv, ring: FileKeystore
) -> None:
    """A sidecar holds a codec per audience (and a new generation's beside the old): one call an interval for
    the key, and all of them fail closed, and serve again, at the same check."""
    plain = {entry[0]: key for entry, key in KMSEnvelopeCodec(ring, audience=AUD, kek_check_every=0)._unwrapped.items()}
    stubber = Stubber(client := _client(kms.proxy.url))
    stubber.activate()
    usable = [k.kid for k in ring.load().usable_keys()]
    service = KMSService(client)
    codecs = []
    for _ in range(2):
        _unwraps(stubber, ring, plain, usable)
        codecs.append(KMSEnvelopeCodec(ring, audience=AUD, service=service, kek_check_every=300))
    check = codecs[0].kek
    try:
        assert check is not None and codecs[1].kek is check and check.running
        stubber.add_client_error("decrypt", service_error_code="DisabledException", http_status_code=400)
        assert check.check() == REVOKED  # one Decrypt: the stubber had one answer queued
        for codec in codecs:
            with pytest.raises(WrappingKeyRevoked):
                codec.seal(b"x")
        _unwraps(stubber, ring, plain, [usable[0], *usable, *usable])  # the check, then each codec's keys
        assert check.check() == OK
        assert all(codec.unseal(codec.seal(b"y")) == b"y" for codec in codecs)
        stubber.assert_no_pending_responses()
    finally:
        check.stop()
