"""A KMS key denied to a fleet stops it within one check interval; KMS out of reach does not (issue 37).

moto's ``Decrypt`` ignores ``DisableKey`` (moto 5.2), so the security team's move is played through moto's IAM
enforcement: a moto server of this test's own (IAM checks are server-wide) with two IAM users, ``admin`` and
``instance``; the instances sign with ``instance``'s keys, and an explicit Deny of ``kms:Decrypt`` put on that
user, then deleted, stands for the key disabled and enabled again (moto evaluates KMS actions against the
resource ``*``, so the Deny names ``*``). Two instances with ``kek_check_every=1``: a library codec of this
process (`mrtr_keys.request_state_security`) and a sidecar (``serve --kek-check-every 1``).

Asserted, each within one interval + the call's deadline (+ what the host delayed, `tests.support.lateness`):
denied, every instance fails closed (seals raise, unseals refused ``wrapping key revoked``, plain and strict
``/readyz`` 503 naming the cause, the audit reason, the metric); allowed again, both serve. Then moto is
stopped (SIGSTOP: connections held, nothing answered) for 20 s: both keep serving throughout, ``/readyz`` is
200 (strict: 503, as for a keystore outage) and the metric says unreachable; SIGCONT: checked ok again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from mcp.server.mcpserver import InvalidRequestState
from prometheus_client import REGISTRY

import mrtr_keys
from mrtr_keys.changes.create import create_ring
from mrtr_keys.codecs.kek import WRAPPING_KEY_REVOKED
from mrtr_keys.errors import WrappingKeyRevoked
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import CodecSpec
from tests.fixtures.audit import cli
from tests.fixtures.moto_kms import AWS_ENV, AWS_UNSET, REGION
from tests.fixtures.sidecar import Sidecar, start_sidecar
from tests.support import tls
from tests.support.lateness import Relay
from tests.support.services import start_moto
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

AUD = "billing"
EVERY = 1.0
DEADLINE = 2 * (1.0 + 1.0)  # the instances' KMS client: 1 s connect + 1 s read timeout, 2 attempts
ALLOW_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
DENY_DECRYPT = {"Version": "2012-10-17", "Statement": [{"Effect": "Deny", "Action": "kms:Decrypt", "Resource": "*"}]}


@dataclass
class IamMoto:
    url: str
    pid: int
    admin_iam: Any
    admin_kms: Any
    instance_env: dict[str, str]
    key_arn: str


@pytest.fixture
def iam_moto(tmp_path: Path) -> Iterator[IamMoto]:
    server = start_moto(tmp_path / "moto", env=AWS_ENV)
    try:
        kw = {"endpoint_url": server.url, "region_name": REGION}
        anon = boto3.session.Session(aws_access_key_id="x", aws_secret_access_key="x")
        iam = anon.client("iam", **kw)
        keys = {}
        for user, policy in (("admin", ALLOW_ALL), ("instance", ALLOW_ALL)):
            iam.create_user(UserName=user)
            iam.put_user_policy(UserName=user, PolicyName="base", PolicyDocument=json.dumps(policy))
            keys[user] = iam.create_access_key(UserName=user)["AccessKey"]
        arn = anon.client("kms", **kw).create_key(Description="issue 37")["KeyMetadata"]["Arn"]
        assert httpx.post(f"{server.url}/moto-api/reset-auth", content=b"0").json()["status"] == "ok"  # enforce now
        admin = boto3.session.Session(
            aws_access_key_id=keys["admin"]["AccessKeyId"], aws_secret_access_key=keys["admin"]["SecretAccessKey"]
        )
        env = {
            **AWS_ENV,
            "AWS_ENDPOINT_URL": server.url,
            "AWS_ACCESS_KEY_ID": keys["instance"]["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": keys["instance"]["SecretAccessKey"],
            "MRTR_KEYS_KMS_CONNECT_TIMEOUT": "1",
            "MRTR_KEYS_KMS_READ_TIMEOUT": "1",
        }
        yield IamMoto(server.url, server.proc.pid, admin.client("iam", **kw), admin.client("kms", **kw), env, arn)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


def _readyz(s: Sidecar, strict: bool = False) -> tuple[int, dict[str, Any]]:
    r = httpx.get(f"{s.url}/readyz", params={"strict": "true"} if strict else None, timeout=10, verify=tls.CONTEXT)
    return r.status_code, r.json()


def _seen(instances: dict[str, Any], check: Any, what: str) -> dict[str, float]:
    """Seconds from now until `check(codec)` held, for each instance (polled in turn: an upper bound each)."""
    t0, took = time.monotonic(), {}
    for name, codec in instances.items():
        until(lambda c=codec: check(c), 30, f"{name} {what}", every=0.05)
        took[name] = time.monotonic() - t0
    return took


def _secs(took: dict[str, float]) -> str:
    return ", ".join(f"{name} {t:.2f} s" for name, t in took.items())


def _metric(s: Sidecar, name: str) -> str:
    text = httpx.get(f"{s.url}/metrics", timeout=10, verify=tls.CONTEXT).text
    return "\n".join(line for line in text.splitlines() if line.startswith(name))


def test_a_kms_key_denied_then_allowed_and_kms_stopped_for_20_s(
    iam_moto: IamMoto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ring = tmp_path / "ring" / "keyring.json"
    create_ring(
        FileKeystore(ring),
        codec=CodecSpec("kms", {"kms_key_id": iam_moto.key_arn}),
        audiences=(AUD,),
        backend_options={"client": iam_moto.admin_kms},
    )
    for name in AWS_UNSET:
        monkeypatch.delenv(name, raising=False)
    for name, value in iam_moto.instance_env.items():
        monkeypatch.setenv(name, value)
    library = mrtr_keys.request_state_security(ring, audience=AUD, kek_check_every=EVERY).codec
    sidecar = start_sidecar(ring, workdir=tmp_path / "sc", extra=("--kek-check-every", "1"), env=iam_moto.instance_env)
    try:
        secret = sidecar.add_client("web", [AUD])
        remote = sidecar.codec(AUD, secret)
        until(lambda: _readyz(sidecar)[0] == 200, 30, "the sidecar is ready")
        instances = {"library": library, "sidecar": remote}
        tokens = {name: codec.seal(b"before") for name, codec in instances.items()}

        def closed(codec: Any) -> bool:
            try:
                codec.seal(b"probe")
            except Exception:  # WrappingKeyRevoked in the library, the sidecar's 503 through its client
                return True
            return False

        # denied: every instance fails closed within one interval + the call's deadline
        with Relay() as relay:
            iam_moto.admin_iam.put_user_policy(
                UserName="instance", PolicyName="deny-decrypt", PolicyDocument=json.dumps(DENY_DECRYPT)
            )
            took = _seen(instances, closed, "fails closed")
        bound = EVERY + DEADLINE + relay.overrun + 0.5
        assert max(took.values()) <= bound, (took, bound)
        print(f"\nkms denied: failing closed after {_secs(took)} (bound {bound:.2f} s)")
        with pytest.raises(WrappingKeyRevoked, match="sealing refused"):
            library.seal(b"x")
        for name, codec in instances.items():
            with pytest.raises(InvalidRequestState):
                codec.unseal(tokens[name])
        for strict in (False, True):
            status, doc = _readyz(sidecar, strict)
            assert status == 503 and "is disabled, deleted or denied" in doc["reason"], doc
            assert doc["wrapping_key"]["state"] == "revoked" and "403" in doc["wrapping_key"]["closed"]
        assert "mrtr_sidecar_wrapping_key_state 2.0" in _metric(sidecar, "mrtr_sidecar_wrapping_key_state")
        assert 'reason="wrapping key revoked"' in _metric(sidecar, "mrtr_sidecar_rejections_total")
        assert REGISTRY.get_sample_value("mrtr_keys_wrapping_key_state") == 2.0
        assert (REGISTRY.get_sample_value("mrtr_keys_rejections_total", {"reason": WRAPPING_KEY_REVOKED}) or 0) >= 1
        assert library.kek.closed and library.kek.state == "revoked"
        until(lambda: "is disabled, deleted or denied to this instance" in sidecar.output(), 10, "the WARNING")
        assert library._observer.sink.flush(10)
        refused = cli("audit", "query", "--reason", WRAPPING_KEY_REVOKED, "--json", keystore=ring).json()
        assert {(e["op"], e["outcome"]) for e in refused} == {("unseal", "rejected")}

        # allowed again: both serve at the next check
        with Relay() as relay:
            iam_moto.admin_iam.delete_user_policy(UserName="instance", PolicyName="deny-decrypt")
            took = _seen(instances, lambda c: not closed(c), "serves again")
        assert max(took.values()) <= EVERY + DEADLINE + relay.overrun + 0.5, took
        print(f"kms allowed again: serving after {_secs(took)}")
        for name, codec in instances.items():
            assert codec.unseal(tokens[name]) == b"before"  # the same data keys, unwrapped again
        # the sidecar checks each of its codecs (the client's audience, readiness's own) on its own cycle
        until(lambda: _readyz(sidecar, strict=True)[0] == 200, EVERY + DEADLINE + 10, "the sidecar is ready again")

        # KMS stopped (silent) for 20 s: an outage, not a revocation; every round is served throughout
        served, failures = [0], []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                for codec in (library, remote):
                    try:
                        assert codec.unseal(codec.seal(b"during")) == b"during"
                        served[0] += 1
                    except Exception as exc:
                        failures.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)

        driver = threading.Thread(target=traffic, daemon=True)
        driver.start()
        os.kill(iam_moto.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            until(lambda: library.kek.state == "unreachable", 30, "the library codec sees the outage")
            until(lambda: _readyz(sidecar)[1].get("wrapping_key", {}).get("state") == "unreachable", 30, "sidecar")
            status, doc = _readyz(sidecar)
            assert status == 200 and doc["ready"] is True, doc  # plain readiness: serving
            status, doc = _readyz(sidecar, strict=True)
            assert status == 503 and "could not be checked" in (doc["reload_error"] or ""), doc
            assert "mrtr_sidecar_wrapping_key_state 1.0" in _metric(sidecar, "mrtr_sidecar_wrapping_key_state")
            time.sleep(max(0.0, 20.0 - (time.monotonic() - stopped)))
        finally:
            os.kill(iam_moto.pid, signal.SIGCONT)
        until(lambda: library.kek.state == "ok", 30, "checked ok again")
        until(lambda: _readyz(sidecar, strict=True)[0] == 200, 30, "strict readiness again")
        stop.set()
        driver.join(30)
        assert failures == [] and served[0] > 100, (failures[:5], served)
        checked = dict(library.kek.checks)
        print(f"kms stopped 20 s: {served[0]} rounds served, {len(failures)} failed; library checks {checked}")
        assert library.kek.closed is None
        checks = _metric(sidecar, "mrtr_sidecar_wrapping_key_checks_total")
        assert 'result="unreachable"' in checks and 'result="revoked"' in checks, checks
    finally:
        sidecar.stop()
        if library.kek is not None:
            library.kek.stop()
