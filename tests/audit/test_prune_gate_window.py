"""`audit prune` / `audit archive` never cut inside the window the rotation gates read (the ring's TTL +
60 s), and a key ring that exists but cannot be read (damaged, or its keystore down) refuses the prune
instead of turning that check off; only a keystore with no ring at all (a store named by --audit alone)
has no window to keep."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.audit_log import fill

from tests.fixtures.audit import cli

pytestmark = pytest.mark.usefixtures("audit_key")  # the CLI verifies keyed links with the fleet's key


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = f"sqlite://{tmp_path}/audit.db"
    fill(url, 300, tx=100)
    return url


@pytest.mark.parametrize("command", ["prune", "archive"])
def test_a_cut_off_inside_the_gate_window_is_refused(store: str, tmp_path: Path, command: str) -> None:
    ring = tmp_path / "ring" / "keyring.json"
    assert cli("init", "--keystore", str(ring)).code == 0
    to = ["--checkpoints", str(tmp_path / "cps.jsonl")] if command == "prune" else ["--to", str(tmp_path / "arch")]
    res = cli("audit", command, "--before", "1s", "--audit", store, "--keystore", str(ring), *to)
    assert res.code == 2 and "is inside the window the rotation gates read" in res.err, res.err


def test_a_ring_that_cannot_be_read_refuses_the_prune_and_deletes_nothing(store: str, tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    ring.write_text("{damaged")
    ring.chmod(0o600)
    res = cli("audit", "prune", "--before", "1s", "--audit", store, "--keystore", str(ring),
              "--checkpoints", str(tmp_path / "cps.jsonl"))  # fmt: skip
    assert res.code == 2 and "cannot read the key ring to keep --before out of the window" in res.err, res.err
    assert len(res.err.strip().splitlines()) == 1
    assert not (tmp_path / "cps.jsonl").exists()  # nothing cut
    assert cli("audit", "verify", "--audit", store).out.startswith("ok: 300 records")


def test_without_a_ring_there_is_no_window_to_keep(store: str, tmp_path: Path) -> None:
    res = cli("audit", "prune", "--before", "1s", "--audit", store, "--keystore", str(tmp_path / "none.json"),
              "--checkpoints", str(tmp_path / "cps.jsonl"))  # fmt: skip
    assert res.code == 0, res.err


@pytest.mark.parametrize("command", ["prune", "archive"])
def test_a_second_prune_or_archive_of_one_checkpoint_file_waits_its_turn(
    store: str, tmp_path: Path, command: str
) -> None:
    """Two overlapping runs recorded their cuts and manifests out of order (the older archive's reference
    last) and left the archive unverifiable: a run holds ``CHECKPOINTS.lock``, as the sidecar's retention
    does, and another run exits 75 (retry later) and changes nothing."""
    from mrtr_keys.audit.retention.prune import pruner_lock

    cps = tmp_path / "cps.jsonl"
    args = (
        ["--checkpoints", str(cps)]
        if command == "prune"
        else ["--to", str(tmp_path / "arch"), "--checkpoints", str(cps)]
    )
    with pruner_lock(cps) as held:
        assert held
        res = cli("audit", command, "--before", "1s", "--audit", store, "--keystore", str(tmp_path / "none"), *args)
    assert res.code == 75 and f"another prune or archive is using {cps}" in res.err, res.err
    assert not cps.exists() and not (tmp_path / "arch" / "manifests").exists()
    res = cli("audit", command, "--before", "1s", "--audit", store, "--keystore", str(tmp_path / "none"), *args)
    assert res.code == 0 and cps.exists(), res.err
