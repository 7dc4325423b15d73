"""An attacker's edits of an archive the other tests do not make: every one is a one-line error and a
non-zero exit from `audit verify --from-archive`, never an internal error, a hang or a pass.

* a manifest (not anchored: no checkpoint names it) whose entries have wrong types, or name a file
  outside the archive (``../``, an absolute path such as ``/dev/zero``);
* a segment rewritten (and re-listed with its new SHA-256) with values of the wrong type;
* a segment or manifest replaced by a link to ``/dev/zero`` or by a FIFO (refused, not read);
* an archive written with a relative ``--to`` and verified by its absolute path (or a copy that
  holds the same manifest): still checked against the SHA-256 the prune checkpoint recorded.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from bench.audit_log import fill

from tests.fixtures.audit import cli

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key


@pytest.fixture(scope="module")
def _archived_once(tmp_path_factory: pytest.TempPathFactory, fleet_key_file: Path) -> Path:
    root = tmp_path_factory.mktemp("archived")
    url, cps = f"sqlite://{root}/audit.db", root / "cps.jsonl"
    with pytest.MonkeyPatch.context() as mp:  # the archive goes to the relative ``arch``
        mp.setenv("MRTR_KEYS_AUDIT_KEY_FILE", str(fleet_key_file))
        fill(url, 1_500, tx=100)
        mp.chdir(root)
        res = cli("audit", "archive", "--before", "30d", "--audit", url, "--to", "arch", "--checkpoints", str(cps))
    assert res.code == 0, res.err
    return root


@pytest.fixture
def archived(_archived_once: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path, Path]:
    """(store URL, checkpoint file, manifest path) after a 30-day archive to the relative ``arch``: a
    copy, file for file, of one made for the module (a copy is the same store: its checkpoints apply)."""
    shutil.copytree(_archived_once, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    url, cps = f"sqlite://{tmp_path}/audit.db", tmp_path / "cps.jsonl"
    return url, cps, next((tmp_path / "arch" / "manifests").glob("*.json"))


def _verify(url: str, cps: Path, location: str = "arch") -> tuple[int, str]:
    res = cli("audit", "verify", "--audit", url, "--checkpoints", str(cps), "--from-archive", location)
    out = (res.out + res.err).strip()
    assert len(out.splitlines()) == 1 and "internal error" not in out and "Traceback" not in out, out
    return res.code, out


def _edit(manifest: Path, change: Any) -> None:
    doc = json.loads(manifest.read_text())
    change(doc)
    manifest.write_text(json.dumps(doc))


def _relist(doc: dict[str, Any], seg: dict[str, Any]) -> None:
    data = (Path("arch") / seg["file"]).read_bytes()
    seg["bytes"], seg["sha256"] = len(data), hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["segments"].__setitem__(0, 5), "segment entry 0 is not an object"),
        (lambda d: d["segments"][0].update(first_seq="abc"), "segment entry 0 has no valid first_seq"),
        (lambda d: d["segments"][0].pop("writer"), "segment entry 0 has no valid writer"),
        (lambda d: d.update(previous="x"), "'previous' link is not a manifest name"),
        (lambda d: d["segments"][0].update(file="/dev/zero"), "names a file outside the archive's segments/"),
        (lambda d: d["segments"][0].update(file="segments/../../cps.jsonl"), "outside the archive's segments/"),
    ],
)
def test_an_unanchored_manifest_with_bad_entries_is_a_break(
    archived: tuple[str, Path, Path], change: Any, message: str
) -> None:
    url, cps, manifest = archived
    cps.unlink()  # nothing anchors the manifest: it is checked on its own
    _edit(manifest, change)
    code, out = _verify(url, cps)
    assert code == 1 and out.startswith("BROKEN: archive: ") and message in out, out


@pytest.mark.parametrize(("column", "value"), [(12, "x"), (13, None), (13, 5)])  # seq; prev_hash
def test_a_rewritten_segment_with_values_of_the_wrong_type_is_a_break(
    archived: tuple[str, Path, Path], column: int, value: Any
) -> None:
    url, cps, manifest = archived
    cps.unlink()

    def rewrite(doc: dict[str, Any]) -> None:
        seg = doc["segments"][0]
        path = Path("arch") / seg["file"]
        rows = [json.loads(line) for line in gzip.decompress(path.read_bytes()).splitlines()]
        rows[99][column] = value  # the last record of the first batch (it carries the hashes)
        path.write_bytes(gzip.compress(("\n".join(json.dumps(r) for r in rows) + "\n").encode()))
        _relist(doc, seg)

    _edit(manifest, rewrite)
    code, out = _verify(url, cps)
    assert code == 1 and "holds records that are not audit records" in out, out


@pytest.mark.parametrize("what", ["segment", "manifest"])
@pytest.mark.parametrize("kind", ["link to /dev/zero", "fifo"])
def test_a_device_or_fifo_in_the_archive_is_refused_not_read(
    archived: tuple[str, Path, Path], what: str, kind: str
) -> None:
    url, cps, manifest = archived
    target = manifest if what == "manifest" else Path("arch") / json.loads(manifest.read_text())["segments"][0]["file"]
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    code, out = _verify(url, cps)
    assert code != 0 and out.endswith("not a regular file"), out


def test_the_checkpoint_anchors_the_manifest_whatever_the_archive_path_is_called(
    archived: tuple[str, Path, Path], tmp_path: Path
) -> None:
    url, cps, manifest = archived
    assert _verify(url, cps, str(tmp_path / "arch"))[0] == 0
    _edit(manifest, lambda d: d.update(before="2000-01-01T00:00:00Z"))
    code, out = _verify(url, cps, str(tmp_path / "arch"))
    assert code == 1 and "does not match the one recorded in the store's prune checkpoint" in out, out


def test_a_checkpoint_file_that_is_a_device_is_refused_not_read(archived: tuple[str, Path, Path]) -> None:
    url, cps, _ = archived
    cps.unlink()
    cps.symlink_to("/dev/zero")
    res = cli("audit", "verify", "--audit", url, "--checkpoints", str(cps), "--from-archive", "arch")
    assert res.code == 2 and "not a checkpoint file (not a regular file)" in res.err, res.err


@pytest.mark.parametrize("what", ["segment", "manifest"])
def test_json_nested_deeper_than_the_parser_goes_is_a_break_not_an_internal_error(
    archived: tuple[str, Path, Path], what: str
) -> None:
    """A manifest, or a segment line, holding one value nested 100,000 deep was ``internal error: RecursionError``
    (any other text that is not JSON is a break)."""
    url, cps, manifest = archived
    cps.unlink()
    deep = "[" * 100_000 + "]" * 100_000
    if what == "manifest":
        manifest.write_text(deep)
        said = "is not JSON (changed after archiving)"
    else:

        def rewrite(doc: dict[str, Any]) -> None:
            seg = doc["segments"][0]
            (Path("arch") / seg["file"]).write_bytes(gzip.compress((deep + "\n").encode()))
            _relist(doc, seg)

        _edit(manifest, rewrite)
        said = "cannot be read as gzip JSON Lines"
    code, out = _verify(url, cps)
    assert code == 1 and out.startswith("BROKEN: archive: ") and said in out, out
