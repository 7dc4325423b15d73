"""`audit verify --from-archive`: a directory that does not exist is a one-line usage error (exit 2,
not "0 archived segments"), and files in the archive that no manifest lists are named in a warning
line and in ``--json`` (an interrupted ``audit archive`` run leaves such files), not silently ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from bench.audit_log import fill

from tests.fixtures.audit import cli

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key


def test_verify_from_an_archive_directory_that_does_not_exist_is_exit_2(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    res = cli("audit", "verify", "--audit", url, "--from-archive", str(tmp_path / "no-such-archive"))
    assert res.code == 2 and res.out == "", (res.code, res.out, res.err)
    missing = tmp_path / "no-such-archive"
    assert res.err.strip().splitlines() == [f"mrtr-keys: --from-archive {missing}: no such directory"]
    (tmp_path / "a-file").write_text("")
    res = cli("audit", "verify", "--audit", url, "--from-archive", str(tmp_path / "a-file"))
    assert res.code == 2 and res.err.strip().splitlines() == [f"mrtr-keys: {tmp_path / 'a-file'}: not a directory"], (
        res.err
    )


def test_files_no_manifest_lists_are_named_in_a_warning_and_in_json(tmp_path: Path) -> None:
    url, cps, to = f"sqlite://{tmp_path}/audit.db", str(tmp_path / "checkpoints.jsonl"), tmp_path / "archive"
    fill(url, 1_200, tx=100)
    res = cli("audit", "archive", "--before", "30d", "--audit", url, "--to", str(to), "--checkpoints", cps)
    assert res.code == 0, res.err
    args = ("audit", "verify", "--audit", url, "--checkpoints", cps, "--from-archive", str(to))
    clean = cli(*args)
    assert clean.code == 0 and "warning" not in clean.err, clean.err
    # what an archive run killed after publishing a segment (before its manifest) leaves, and its staging
    (to / "segments" / "20991231T000000Z").mkdir(parents=True)
    (to / "segments" / "20991231T000000Z" / "w.1-9.jsonl.gz").write_bytes(b"\x1f\x8b")
    (to / ".staging-x1").mkdir()
    (to / ".staging-x1" / "open-1-7.jsonl.gz").write_bytes(b"")
    stray = [".staging-x1/open-1-7.jsonl.gz", "segments/20991231T000000Z/w.1-9.jsonl.gz"]
    res = cli(*args)
    assert res.code == 0 and res.out.startswith("ok: 1200 records"), res.out + res.err
    warning = res.err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"mrtr-keys: warning: 2 files in {to} listed by no manifest")
    assert warning[0].endswith(": " + ", ".join(stray)) and "interrupted audit archive run" in warning[0]
    doc = json.loads(cli(*args, "--json").out)
    assert doc["ok"] and doc["archive"]["unlisted"] == stray
    # what is not a file is named too, and a name cannot add a line of its own to the output
    os.mkfifo(to / "fifo")
    (to / "dangling").symlink_to(tmp_path / "nowhere")
    (to / "segments" / "x\nok: 9999 records verified").write_bytes(b"")
    res = cli(*args)
    assert res.code == 0, res.err
    warning = res.err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"mrtr-keys: warning: 5 files in {to}"), res.err
    assert warning[0].endswith(
        ": " + ", ".join([stray[0], "dangling", "fifo", stray[1], repr("segments/x\nok: 9999 records verified")])
    )
    doc = json.loads(cli(*args, "--json").out)
    assert doc["archive"]["unlisted"] == [
        stray[0],
        "dangling",
        "fifo",
        stray[1],
        "segments/x\nok: 9999 records verified",
    ]
