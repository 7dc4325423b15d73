"""``make bench-check`` (bench/check.py, issue 41): its verdict and its probe. The full A/B (a base revision
built in a worktree, sidecars, wrk) runs in ``.ci/run`` after ``make test``; here, what decides it: a HEAD
row more than 20 % worse than the base fails, a row within it passes, the on/off rows only inform; the base
defaults to the commit of docs/performance.md's table; the probe measures both kinds of row with this
interpreter's package (the one each side runs); the base is built from a lock, never resolved; and what is no
regression of HEAD (a base it cannot have, build or run) does not fail it, while a HEAD that cannot run does."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from bench.check import HeadFailed, NotChecked, Row, _probe, _Sidecar, base_python, render, resolve, table_revision
from packaging.utils import canonicalize_name

from tests.supply.pins import REPO, locked_pins


def _row(name: str, base: float, head: float, *, higher: bool = True, gated: bool = True) -> Row:
    row = Row(name, "ev/s" if higher else "µs", higher, gated)
    row.samples = {"base": [base, base * 1.1, base * 0.9], "head": [head, head * 1.1, head * 0.9]}
    return row


def _rows(writer_head: float, inprocess_head: float) -> list[Row]:
    rows = [
        _row("local seal+unseal, audit on (flush included)", 20.0, inprocess_head, higher=False),
        _row("local seal+unseal, audit off", 5.0, 5.0, higher=False, gated=False),
        _row("audit writer, SQLite", 100_000, writer_head),
    ]
    for label in ("seal", "seal batch(100)"):
        rows += [_row(f"sidecar {label} c=16, audit on", 10_000, 10_000)]
        rows += [_row(f"sidecar {label} c=16, audit off", 12_000, 1_000, gated=False)]  # informs only
    return rows


def test_a_row_more_than_a_fifth_worse_fails_and_one_within_it_passes() -> None:
    text, ok = render(_rows(writer_head=85_000, inprocess_head=23.0), "95b81a7", "HEAD")
    assert ok and "| audit writer, SQLite | 100,000 ev/s | 85,000 ev/s | -15% | PASS |" in text
    assert "| sidecar seal c=16, audit off | 12,000 ev/s | 1,000 ev/s | -92% | info |" in text
    text, ok = render(_rows(writer_head=79_000, inprocess_head=23.0), "95b81a7", "HEAD")
    assert not ok and "| -21% | FAIL |" in text
    text, ok = render(_rows(writer_head=100_000, inprocess_head=25.5), "95b81a7", "HEAD")  # µs: lower is better
    assert not ok and "| local seal+unseal, audit on (flush included) | 20.0 µs | 25.5 µs | -22% | FAIL |" in text
    assert "sidecar seal batch(100) c=16: audit on/off base 0.83x, HEAD 10.00x" in text


def test_a_row_is_judged_by_its_rounds_own_ratios_so_one_burst_per_side_is_not_a_failure() -> None:
    """Round 2 of HEAD and round 3 of the base fell into bursts of the host's load: the medians of each side
    (100 against 60) would read -40 %; the rounds themselves say HEAD is 5 % slower. A real regression is
    slower in every round."""
    noisy = Row("audit writer, SQLite", "ev/s", True)
    noisy.samples = {"base": [100.0, 100.0, 60.0], "head": [95.0, 60.0, 57.0]}
    assert round(noisy.change(), 2) == -0.05
    text, ok = render([*_rows(100_000, 20.0)[:2], noisy, *_rows(100_000, 20.0)[3:]], "95b81a7", "HEAD")
    assert ok and "| audit writer, SQLite | 100 ev/s | 60 ev/s | -5% | PASS |" in text
    slower = Row("audit writer, SQLite", "ev/s", True)
    slower.samples = {"base": [100.0, 100.0, 60.0], "head": [70.0, 75.0, 45.0]}
    assert round(slower.change(), 2) == -0.25


def test_the_base_defaults_to_the_commit_of_the_performance_table(tmp_path: Path) -> None:
    docs = tmp_path / "performance.md"
    docs.write_text("## Latest table\n\nRun of 2026-12-01T22:01:01+00:00 (git 95b81a7), parts: audit; 564.3 s.\n")
    assert table_revision(docs) == "95b81a7"
    assert table_revision()  # the repository's own table names one


def test_the_probe_measures_both_in_process_rows_with_this_package(tmp_path: Path) -> None:
    from bench import check_probe  # what each side's interpreter runs as a script, here with HEAD's package

    inprocess = check_probe.inprocess(200, tmp_path / "ip")
    assert inprocess["on_us"] > 0 and inprocess["off_us"] > 0
    assert check_probe.writer(2_000, tmp_path / "w")["events_per_s"] > 0


def test_a_base_older_than_the_lock_is_built_from_heads_lock_and_nothing_is_resolved(tmp_path: Path) -> None:
    """95b81a7 (the table's commit) predates uv.lock: its venv holds HEAD's locked runtime set and build
    backend, each artifact checked against its sha256, and the base's own package; its Makefile (which
    resolved every dependency afresh from the registry, so CI ran unreviewed code) is not used."""
    python = base_python(resolve("95b81a7"), tmp_path)
    venv = python.parent.parent
    log = (tmp_path / "95b81a735bde.build.log").read_text()
    assert "make" not in log.split() and log.count("--require-hashes --no-deps") == 1
    site = [str(p) for p in venv.glob("lib/python*/site-packages")]
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=site)}
    assert installed.pop("mrtr-keys") == "0.1.0"  # the base's own package, not HEAD's
    locked = locked_pins(REPO / "requirements" / "image.txt") | locked_pins(REPO / "requirements" / "build.txt")
    assert installed == locked
    assert base_python(resolve("95b81a7"), tmp_path) == python  # built once, then reused
    # the probes run with the base's package too (a module moved since is looked up where the base has it)
    for row, n in (("inprocess", "200"), ("writer", "2000")):
        done = subprocess.run(
            [str(python), str(REPO / "bench" / "check_probe.py"), row, n, str(tmp_path / row)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-500:]
        assert all(v > 0 for v in json.loads(done.stdout.splitlines()[-1]).values())


def test_a_base_this_clone_lacks_is_not_checked_and_a_named_one_is_a_bad_command_line() -> None:
    with pytest.raises(NotChecked, match="is not in this clone"):
        resolve("0" * 40)  # the default base of a shallow clone: CI passes, saying so
    done = subprocess.run(
        [sys.executable, "-m", "bench.check", "--base", "no-such-rev"], cwd=REPO, capture_output=True, text=True
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "bench-check: the base revision no-such-rev is not in this clone (a shallow clone? git fetch --unshallow)\n"
    )


@pytest.mark.parametrize("bad", [["--rounds", "0"], ["--seconds", "0"], ["--seconds", "nan"]])
def test_no_rounds_or_seconds_to_measure_is_a_bad_command_line_not_a_regression(bad: list[str]) -> None:
    """`--rounds 0` built the base, measured nothing and failed every row as a regression (the median ratio of no
    rounds is NaN, which is not within the tolerance); `--seconds 0` made wrk fail, reported as 'not checked'."""
    done = subprocess.run([sys.executable, "-m", "bench.check", *bad], cwd=REPO, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines()[-1] == (
        "python -m bench.check: error: --rounds must be at least 1 and --seconds from 0 to 3600 (not included)"
    )


def test_a_base_that_cannot_run_is_not_checked_and_a_head_that_cannot_fails(tmp_path: Path) -> None:
    false = Path("/bin/false")
    with pytest.raises(NotChecked, match=r"^base: the writer probe failed"):
        _probe(false, "base", "writer", "10", str(tmp_path))
    with pytest.raises(HeadFailed, match=r"^HEAD: the writer probe failed"):
        _probe(false, "head", "writer", "10", str(tmp_path))
    with pytest.raises(NotChecked, match=r"^base: a sidecar \(audit on\) did not start"):
        _Sidecar(false, "base", tmp_path / "sc", "on")
