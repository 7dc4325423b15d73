"""`audit archive` writes what a prune deletes as segments + a manifest (a directory, or S3 on moto with
Object Lock), prunes, and `audit verify --from-archive` checks archive and live store as one history; a
changed byte in a segment, a missing segment, a reordered manifest each fail with a clear message.

Logs are genuine (`bench.audit_log.fill`), 12 000 events over the last 40 days in transactions of 100
(500 for S3) on three chains, so a 30-day archive cuts every chain at a batch boundary.
"""

from __future__ import annotations

import gzip
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from bench.audit_log import DAY, fill

from tests.fixtures.audit import cli

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key

EVENTS = 12_000


def _archive(url: str, cps: Path, to: str, before: str = "30d", *extra: str) -> dict[str, Any]:
    res = cli(
        "audit", "archive", "--before", before, "--audit", url, "--to", to, "--checkpoints", str(cps), "--json", *extra
    )
    assert res.code == 0, res.err
    return dict(json.loads(res.out))


def _verify(url: str, cps: Path, archive: str) -> tuple[int, str]:
    res = cli("audit", "verify", "--audit", url, "--checkpoints", str(cps), "--from-archive", archive)
    return res.code, res.out + res.err


@pytest.fixture
def archived(tmp_path: Path) -> tuple[str, Path, Path, dict[str, Any]]:
    """(store URL, checkpoint file, archive directory, archive result) after a 30-day archive."""
    url, cps, to = f"sqlite://{tmp_path}/audit.db", tmp_path / "checkpoints.jsonl", tmp_path / "archive"
    fill(url, EVENTS, tx=100)  # batches of 8 hours' events: several segments (UTC days) per chain
    return url, cps, to, _archive(url, cps, str(to))


def test_archive_to_a_directory_prunes_and_verify_from_archive_passes(
    archived: tuple[str, Path, Path, dict[str, Any]],
) -> None:
    url, cps, to, result = archived
    assert len(result["cuts"]) == 3 and result["archived"] == result["deleted"] >= 2_500
    manifest = json.loads((to / result["manifest"]).read_text())
    assert manifest["previous"] is None and manifest["records"] == result["archived"]
    seg = manifest["segments"][0]
    assert {"first_seq", "last_seq", "prev_hash", "hash", "sha256", "batches"} <= set(seg) and seg["first_seq"] == 1
    first = json.loads(gzip.decompress((to / seg["file"]).read_bytes()).splitlines()[0])
    assert first[manifest["columns"].index("seq")] == 1  # JSON Lines, one record a line, gzip
    cut = json.loads(cps.read_text().splitlines()[-1])
    assert cut["kind"] == "prune" and cut["archive"]["manifest"] == result["manifest"]
    code, out = _verify(url, cps, str(to))
    assert code == 0 and out.startswith(f"ok: {EVENTS} records in 3 chains"), out
    # a second run chains its manifest to the first; archive and live store still verify as one
    second = _archive(url, cps, str(to), "20d")
    assert second["archived"] == second["deleted"] > 2_000
    assert json.loads((to / second["manifest"]).read_text())["previous"]["manifest"] == result["manifest"]
    code, out = _verify(url, cps, str(to))
    assert code == 0 and f"of them from {result['segments'] + second['segments']} archived segments in 2" in out, out


def _reorder(manifest: Path) -> None:
    doc = json.loads(manifest.read_text())
    segs = doc["segments"]
    i, j = [n for n, s in enumerate(segs) if s["writer"] == segs[0]["writer"]][:2]  # one chain's first two
    segs[i], segs[j] = segs[j], segs[i]
    manifest.write_text(json.dumps(doc, indent=1) + "\n")


def _change_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("changed byte", "its SHA-256 does not match manifest"),
        ("missing segment", "is missing"),
        ("reordered manifest", "the manifest was reordered or edited"),
    ],
)
def test_a_damaged_archive_fails_verify_with_a_clear_message(
    damage: str, message: str, archived: tuple[str, Path, Path, dict[str, Any]]
) -> None:
    url, cps, to, result = archived
    manifest = to / result["manifest"]
    segment = to / json.loads(manifest.read_text())["segments"][1]["file"]
    if damage == "changed byte":
        _change_byte(segment)
    elif damage == "missing segment":
        segment.unlink()
    else:
        _reorder(manifest)
    code, out = _verify(url, cps, str(to))
    assert code == 1 and out.startswith("BROKEN: archive: ") and message in out, out
    if damage != "reordered manifest":
        assert str(segment.relative_to(to)) in out


def test_a_prune_without_the_archive_is_caught(archived: tuple[str, Path, Path, dict[str, Any]]) -> None:
    url, cps, to, _ = archived
    assert cli("audit", "prune", "--before", "20d", "--audit", url, "--checkpoints", str(cps)).code == 0
    code, out = _verify(url, cps, str(to))
    assert code == 1 and "pruned without an archive" in out, out


def test_bad_archive_locations_are_one_line_errors(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    for to, extra, text in [
        ("ftp://x/y", (), "use a directory path or s3://BUCKET/PREFIX"),
        ("", (), "the archive location is empty"),  # --to "$UNSET" archived to the current directory
        (str(tmp_path / "a"), ("--retain-days", "3"), "apply to an s3:// archive"),
    ]:
        res = cli("audit", "archive", "--before", "30d", "--audit", url, "--to", to, *extra)
        assert res.code != 0 and text in res.err and "Traceback" not in res.err, res.err


def test_archive_to_s3_with_object_lock_then_verify_and_tampering(s3: Any, tmp_path: Path) -> None:
    bucket = f"audit-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket, ObjectLockEnabledForBucket=True)
    url, cps, to = f"sqlite://{tmp_path}/audit.db", tmp_path / "checkpoints.jsonl", f"s3://{bucket}/fleet-a"
    fill(url, EVENTS, tx=500)
    result = _archive(url, cps, to, "30d", "--retain-days", "2")
    assert result["retention"] == "Object Lock GOVERNANCE, 2 day(s) per object (--retain-days)"
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=f"fleet-a/{result['manifest']}")["Body"].read())
    key = f"fleet-a/{manifest['segments'][1]['file']}"
    assert s3.head_object(Bucket=bucket, Key=key)["ObjectLockMode"] == "GOVERNANCE"
    code, out = _verify(url, cps, to)
    assert code == 0 and out.startswith(f"ok: {EVENTS} records in 3 chains"), out
    # Object Lock keeps the archived version; a newer version (a changed byte) or a delete marker is caught
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    code, out = _verify(url, cps, to)
    assert code == 1 and "its SHA-256 does not match manifest" in out, out
    s3.delete_object(Bucket=bucket, Key=key)
    code, out = _verify(url, cps, to)
    assert code == 1 and f"segment {manifest['segments'][1]['file']} listed in manifest" in out, out


def test_retain_days_needs_a_bucket_with_object_lock(s3: Any, tmp_path: Path) -> None:
    bucket = f"audit-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    url = f"sqlite://{tmp_path}/audit.db"
    fill(url, 1_000, tx=500)
    res = cli("audit", "archive", "--before", "30d", "--audit", url, "--to", f"s3://{bucket}", "--retain-days", "1",
              "--checkpoints", str(tmp_path / "cps.jsonl"))  # fmt: skip
    assert res.code != 0 and "does not have Object Lock enabled" in res.err and "Traceback" not in res.err, res.err


def test_archive_of_a_postgresql_store_verifies(postgres_url: str, tmp_path: Path) -> None:
    cps, to = tmp_path / "checkpoints.jsonl", tmp_path / "archive"
    fill(postgres_url, 3_000, tx=100, span=4 * DAY)  # 4 days, not 40: PostgreSQL makes a table a day
    result = _archive(postgres_url, cps, str(to), "3d")
    assert result["archived"] == result["deleted"] > 500
    code, out = _verify(postgres_url, cps, str(to))
    assert code == 0 and out.startswith("ok: 3000 records in 3 chains"), out


def test_without_retain_days_the_bucket_default_retention_applies_and_is_named(s3: Any, tmp_path: Path) -> None:
    bucket = f"audit-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket, ObjectLockEnabledForBucket=True)
    rule = {"DefaultRetention": {"Mode": "COMPLIANCE", "Days": 1}}
    s3.put_object_lock_configuration(
        Bucket=bucket, ObjectLockConfiguration={"ObjectLockEnabled": "Enabled", "Rule": rule}
    )
    url = f"sqlite://{tmp_path}/audit.db"
    fill(url, 1_500, tx=100)
    result = _archive(url, tmp_path / "cps.jsonl", f"s3://{bucket}")
    assert result["retention"] == "Object Lock COMPLIANCE, 1 day(s) (the bucket's default retention)"
    code, out = _verify(url, tmp_path / "cps.jsonl", f"s3://{bucket}")
    assert code == 0, out


def test_one_checkpoint_file_naming_two_archive_locations_verifies(
    archived: tuple[str, Path, Path, dict[str, Any]], tmp_path: Path
) -> None:
    """An archive that moved: the first run to one directory, the next to another, both recorded in one
    checkpoint file. The newer location's manifest names the older one's (``previous.location``), and
    verify follows it there: from the newer location alone, or with both named, in either order."""
    url, cps, first, _ = archived
    second = tmp_path / "moved"
    result = _archive(url, cps, str(second), "20d")
    assert result["archived"] > 0
    records = [json.loads(line) for line in cps.read_text().splitlines()]
    assert [r["archive"]["location"] for r in records if "archive" in r] == [str(first), str(second)]
    for where in ([str(second)], [str(second), str(first)], [str(first), str(second)]):
        args = [a for w in where for a in ("--from-archive", w)]
        res = cli("audit", "verify", "--audit", url, "--checkpoints", str(cps), *args)
        assert res.code == 0 and res.out.startswith(f"ok: {EVENTS} records in 3 chains"), res.out + res.err
        assert "from 2 manifests" not in res.out and "in 2 manifests at" in res.out, res.out
    shutil.rmtree(first)  # the older location gone: one line, not a pass
    code, out = _verify(url, cps, str(second))
    assert code == 1 and f"in another archive location, {first}, which cannot be read here" in out, out
