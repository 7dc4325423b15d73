"""``mrtr-keys serve --audit-anchor DEST --audit-anchor-every 1``: the sidecar anchors its chains' heads by
itself, to a directory or to S3 with Object Lock (moto); after traffic, the newest 100 records deleted from
the store are caught by ``audit verify --checkpoints DEST`` with nobody having run ``audit checkpoint``. A
destination that cannot be written: sealing goes on, the authenticated ``/readyz`` and the metrics say so.
Exit codes of the commands that read or write a destination: 75 when it cannot be read or written now."""

from __future__ import annotations

import base64
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.audit import cli, sqlite_exec
from tests.fixtures.moto_kms import AWS_UNSET, aws_env
from tests.support.proxy import CountingProxy
from tests.support.waiting import until

pytestmark = pytest.mark.usefixtures("audit_key")  # the sidecar and the CLI share the fleet's key

PAIRS = 150
"""Seal + unseal pairs of the traffic: 300 events, more than the 100 deleted."""


def _traffic(http: Any, pairs: int = PAIRS) -> None:
    items = [{"audience": "billing", "payload": base64.urlsafe_b64encode(os.urandom(24)).decode().rstrip("=")}] * pairs
    sealed = http.post("/v1/seal/batch", json={"items": items})
    assert sealed.status_code == 200, sealed.text
    tokens = [{"audience": "billing", "token": r["token"]} for r in sealed.json()["results"]]
    assert http.post("/v1/unseal/batch", json={"items": tokens}).status_code == 200


def _anchor_status(http: Any) -> dict[str, Any]:
    return dict(http.get("/readyz").json().get("audit_anchor") or {})


def _sidecar(sidecar_factory: Any, keystore_path: Path, url: str, dest: str, env: dict[str, str]) -> Any:
    return sidecar_factory(
        keystore_path,
        extra=["--audit-anchor", dest, "--audit-anchor-every", "1"],
        env={**os.environ, "MRTR_KEYS_AUDIT": url, **env},
    )


def _s3_destination(s3: Any) -> str:
    bucket = f"anchors-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket, ObjectLockEnabledForBucket=True)
    rule = {"DefaultRetention": {"Mode": "GOVERNANCE", "Days": 1}}
    s3.put_object_lock_configuration(
        Bucket=bucket, ObjectLockConfiguration={"ObjectLockEnabled": "Enabled", "Rule": rule}
    )
    return f"s3://{bucket}/fleet-a"


@pytest.mark.parametrize("where", ["directory", "s3"])
def test_the_sidecars_own_anchors_catch_the_newest_100_records_deleted(
    where: str, keystore_path: Path, sidecar_factory: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    if where == "directory":
        dest = f"{tmp_path}/anchors/"
    else:  # this process's AWS environment points at moto: the sidecar inherits it
        s3 = request.getfixturevalue("s3")
        dest = _s3_destination(s3)
    sidecar = _sidecar(sidecar_factory, keystore_path, url, dest, {})
    http = sidecar.http(sidecar.add_client("app", ["billing"]))
    _traffic(http)
    # every event stored and then anchored: the last runs after the store holds them all
    until(lambda: _count(url) >= 2 * PAIRS + 1, 30, every=0.1)  # the ring-loaded and the 300 events
    anchors_then = _anchor_status(http)["anchors"]
    until(lambda: _anchor_status(http)["anchors"] >= anchors_then + 2, 30, every=0.2)
    status = _anchor_status(http)
    assert status["destination"] == dest.rstrip("/") + ("/" if where == "directory" else "") and status["error"] is None
    assert status["every_seconds"] == 1.0 and status["last_success"] and status["failures"] == 0
    metrics = http.get("/metrics").text
    assert re.search(r"^mrtr_sidecar_audit_anchor_last_success_timestamp_seconds [1-9]", metrics, re.M), metrics
    if where == "s3":
        objects = s3.list_objects_v2(Bucket=dest.split("/")[2], Prefix="fleet-a/anchors/")["Contents"]
        head = s3.head_object(Bucket=dest.split("/")[2], Key=objects[0]["Key"])
        assert len(objects) >= 2 and head["ObjectLockMode"] == "GOVERNANCE"  # each anchor locked as written
    code, out = _verify(url, dest, keystore_path)
    assert code == 0 and "checkpointed head" in out and " 0 checkpointed" not in out, out
    sqlite_exec(url, "DELETE FROM audit_events WHERE id IN (SELECT id FROM audit_events ORDER BY id DESC LIMIT 100)")
    code, out = _verify(url, dest, keystore_path)
    assert code == 1 and "truncated" in out.splitlines()[0], out


def _count(url: str) -> int:
    import sqlite3

    conn = sqlite3.connect(url.removeprefix("sqlite://"))
    try:
        return int(conn.execute("SELECT COUNT(*) FROM audit_events").fetchone()[0])
    finally:
        conn.close()


def _verify(url: str, dest: str, keystore: Path) -> tuple[int, str]:
    res = cli("audit", "verify", "--audit", url, "--keystore", str(keystore), "--checkpoints", dest)
    return res.code, (res.out + res.err).strip()


def test_a_destination_that_cannot_be_written_stops_no_seal_and_readyz_and_metrics_say_so(
    keystore_path: Path, sidecar_factory: Any, tmp_path: Path
) -> None:
    url, place = f"sqlite://{tmp_path}/audit.db", tmp_path / "anchors"
    sidecar = _sidecar(sidecar_factory, keystore_path, url, f"{place}/", {})
    http = sidecar.http(sidecar.add_client("app", ["billing"]))
    _traffic(http, 10)
    until(lambda: _anchor_status(http)["anchors"] >= 1, 30, every=0.2)
    shutil.rmtree(place)
    place.write_text("not a directory")  # the destination cannot be written now
    until(lambda: _anchor_status(http)["failures"] >= 2, 30, every=0.2)
    _traffic(http, 50)  # sealing goes on
    ready = http.get("/readyz")
    status = ready.json()["audit_anchor"]
    assert ready.status_code == 200 and status["error"] and f"cannot append to {place}/" in status["error"], status
    metrics = http.get("/metrics").text
    failed = re.search(r"^mrtr_sidecar_audit_anchor_failures_total (\S+)$", metrics, re.M)
    assert failed is not None and float(failed.group(1)) >= 2, metrics
    assert "audit anchor to" in sidecar.output() and "sealing goes on" in sidecar.output()
    assert sidecar.http().get("/readyz").json().get("audit_anchor") is None  # only for an authenticated caller


def _checkpoint(url: str, dest: str, keystore: Path) -> tuple[int, str]:
    res = cli("audit", "checkpoint", "--audit", url, "--keystore", str(keystore), "--checkpoints", dest)
    return res.code, (res.out + res.err).strip()


@pytest.mark.parametrize("case", ["checkpoint to a directory that cannot be written", "checkpoint to silent S3",
                                  "verify from silent S3"])  # fmt: skip
def test_a_destination_that_cannot_be_read_or_written_now_exits_75_in_one_line(
    case: str, tmp_path: Path, moto_server: str, monkeypatch: pytest.MonkeyPatch, keystore_path: Path
) -> None:
    from bench.audit_log import fill

    url = f"sqlite://{tmp_path}/audit.db"
    fill(url, 300, tx=100)
    if "directory" in case:
        (tmp_path / "anchors").write_text("not a directory")
        code, out = _checkpoint(url, f"{tmp_path}/anchors/", keystore_path)
        assert code == 75 and len(out.splitlines()) == 1 and "Not a directory" in out, out
        return
    proxy = CountingProxy(int(moto_server.rsplit(":", 1)[1]))
    try:
        for name in AWS_UNSET:
            monkeypatch.delenv(name, raising=False)
        for name, value in aws_env(proxy.url).items():
            monkeypatch.setenv(name, value)
        proxy.faults.blackhole()  # connections accepted, nothing answered
        started = time.monotonic()
        if "verify" in case:
            res = cli("audit", "verify", "--audit", url, "--checkpoints", "s3://silent-bucket/anchors")
            code, out = res.code, (res.out + res.err).strip()
        else:
            code, out = _checkpoint(url, "s3://silent-bucket/anchors", keystore_path)
        assert code == 75 and len(out.splitlines()) == 1 and "s3://silent-bucket" in out, out
        assert time.monotonic() - started < 30  # the records' S3 deadlines, not a hang
    finally:
        proxy.close()
