"""``serve --audit-retention 30d``: a running sidecar prunes its audit log by itself, in a background
thread, while requests keep coming; nothing in the kept window is lost, ``audit verify`` passes after,
and ``/readyz`` and ``/metrics`` say when the last run succeeded. The store starts with 6 000 genuine
events over the last 40 days (`bench.audit_log.fill`); runs every 0.3 s (``--audit-retention-interval``)."""

from __future__ import annotations

import base64
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from bench.audit_log import fill

from mrtr_keys.audit.events import format_ts
from mrtr_keys.audit.writing.stores.narrow import Codec
from tests.fixtures.audit import cli


def _count_since(db: Path, since: str) -> int:
    """Events at or after `since` (schema 4 stores a time as integer microseconds: `narrow.Codec`)."""
    conn = sqlite3.connect(db)
    try:
        bound = Codec().encode_time(since)
        return int(conn.execute("SELECT COUNT(*) FROM audit_events WHERE time >= ?", (bound,)).fetchone()[0])
    finally:
        conn.close()


def test_the_sidecar_prunes_by_itself_while_serving_and_keeps_the_window(
    keystore_path: Path, sidecar_factory: Any, tmp_path: Path, audit_key: bytes
) -> None:
    db, cps = tmp_path / "audit.db", tmp_path / "checkpoints.jsonl"
    url = f"sqlite://{db}"
    fill(url, 6_000, tx=500)
    kept_from = format_ts(time.time() - 30 * 86_400 + 600)  # the window every run keeps (runs move it by seconds)
    kept = _count_since(db, kept_from)
    env = {"MRTR_KEYS_AUDIT": url, "MRTR_KEYS_AUDIT_CHECKPOINTS": str(cps)}
    sidecar = sidecar_factory(
        keystore_path,
        extra=["--audit-retention", "30d", "--audit-retention-interval", "0.3"],
        env={**os.environ, **env},
    )
    http = sidecar.http(sidecar.add_client("app", ["billing"]))
    probe = sidecar.http()
    served = 0
    deadline = time.monotonic() + 60
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        for _ in range(20):  # traffic continues throughout
            payload = base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")
            r = http.post("/v1/seal", json={"audience": "billing", "payload": payload})
            assert r.status_code == 200, r.text
            assert http.post("/v1/unseal", json={"audience": "billing", "token": r.json()["token"]}).status_code == 200
            served += 1
        status = probe.get("/readyz").json().get("audit_retention") or {}
        if status.get("last_success") and served >= 100 and status.get("last_deleted", 0) == 0:
            break  # pruned (an earlier run deleted), and a later run found nothing more to delete
    assert status.get("last_success") and status.get("error") is None, status
    assert status["keep"] == "30d" and status["interval_seconds"] == 0.3
    metrics = probe.get("/metrics").text
    deleted = [ln for ln in metrics.splitlines() if ln.startswith("mrtr_sidecar_audit_retention_deleted_total ")]
    assert deleted and float(deleted[0].split()[1]) >= 1_000, metrics
    assert "mrtr_sidecar_audit_retention_last_success_timestamp_seconds " in metrics
    sidecar.stop()  # the last audit events flushed
    cut = json.loads(cps.read_text().splitlines()[-1])
    assert cut["kind"] == "prune" and len(cut["cuts"]) >= 3
    # nothing lost from the kept window: every kept fill event and every served request's two events
    assert _count_since(db, kept_from) >= kept + 2 * served
    res = cli("audit", "verify", "--audit", url, "--checkpoints", str(cps), "--json")
    doc = json.loads(res.out)
    assert res.code == 0 and doc["ok"] and doc["pruned_before"], res.out + res.err
    # `audit stats` (hourly totals: added by the writer, recounted by each retention run while the
    # traffic wrote) still counts exactly what is stored, as a whole and in a window
    total = sum(row["count"] for row in json.loads(cli("audit", "stats", "--by", "op", "--audit", url, "--json").out))
    recent = json.loads(cli("audit", "stats", "--by", "op", "--audit", url, "--since", kept_from, "--json").out)
    assert total == _count_since(db, "1970-01-01T00:00:00.000000Z")
    assert sum(row["count"] for row in recent) == _count_since(db, kept_from)


def test_a_bad_retention_setting_is_a_one_line_error(keystore_path: Path) -> None:
    for args, text in [
        (["--audit-retention", "soon"], "audit_retention must be a duration such as 30d"),
        (["--audit-retention", "2026-01-01"], "audit_retention must be a duration such as 30d"),
        (["--audit-retention", "30d", "--audit-retention-interval", "0"], "audit_retention_interval must be"),
        (["--audit-retention", "-5d"], "audit_retention must be a positive duration such as 30d, not '-5d'"),
        (["--audit-retention", "0h"], "audit_retention must be a positive duration such as 30d"),
    ]:
        res = cli("serve", "--keystore", str(keystore_path), *args)
        assert res.code == 2 and text in res.err and "Traceback" not in res.err, res.err
        assert len(res.err.strip().splitlines()) == 1, res.err


def test_retention_over_a_store_it_cannot_prune_is_refused_at_start(keystore_path: Path, tmp_path: Path) -> None:
    """A JSON-lines log is rotated by its shipper, and with auditing off there is nothing to prune: the sidecar
    refuses to start (it used to start and then fail every run, seen only in /readyz)."""
    log = tmp_path / "audit.jsonl"
    for audit, text in [
        (f"jsonl://{log}", "audit_retention cannot prune jsonl://"),
        ("off", "audit_retention needs an audit store, but auditing is off"),
    ]:
        res = cli("--audit", audit, "serve", "--keystore", str(keystore_path), "--audit-retention", "30d")
        assert res.code == 2 and text in res.err and "Traceback" not in res.err, res.err
        assert len(res.err.strip().splitlines()) == 1, res.err
    assert not log.exists()
