"""`make deps-audit` (tools/deps_audit.py; issue 39, deliverable 2; docs/supply-chain.md).

The real pip-audit and npm audit run over the real exported lock files; the vulnerability service is a loopback
one speaking OSV's and the npm registry's APIs (tests/support/advisories.py), so a finding, a reviewed
exception, an expired one and an outage each happen on demand. What the test asserts is what CI's log shows
and its exit code: a known vulnerability fails, a reviewed exception passes until its ignoreUntil, and a
service that cannot be reached (refused or silent) is one line and passes.
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.supply.pins import REPO, locked_pins
from tests.support.advisories import AdvisoryServer, npm_advisory, osv_record, silent_port
from tests.support.net import refused_port

OSV = "https://api.osv.dev/v1/query"

pytestmark = pytest.mark.e2e

BUILD = REPO / "requirements" / "build.txt"  # a real locked file of four packages: quick to audit
SETUPTOOLS = locked_pins(BUILD)["setuptools"]
TODAY = dt.date(2026, 12, 6)
REVIEW = "deps-audit: 1 known vulnerability not reviewed"


@pytest.fixture
def advisories() -> Iterator[AdvisoryServer]:
    server = AdvisoryServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def npm_package(tmp_path: Path) -> Path:
    """A package with one runtime dependency (left-pad 1.3.0) in its lockfile, which npm audit --omit=dev asks
    about (clients/typescript has none: its only dependency is a peer)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    deps = {"left-pad": "1.3.0"}
    (pkg / "package.json").write_text(json.dumps({"name": "audited", "version": "1.0.0", "dependencies": deps}))
    lock = {
        "name": "audited",
        "version": "1.0.0",
        "lockfileVersion": 3,
        "requires": True,
        "packages": {
            "": {"name": "audited", "version": "1.0.0", "dependencies": deps},
            "node_modules/left-pad": {
                "version": "1.3.0",
                "resolved": "https://registry.npmjs.org/left-pad/-/left-pad-1.3.0.tgz",
                "license": "WTFPL",
            },
        },
    }
    (pkg / "package-lock.json").write_text(json.dumps(lock))
    return pkg


def deps_audit(*args: str | Path, ignore: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(REPO / "tools" / "deps_audit.py"), "--today", TODAY.isoformat(), *map(str, args)]
    if ignore is not None:
        argv += ["--ignore", str(ignore)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_every_locked_package_is_asked_about_and_a_clean_answer_passes(
    advisories: AdvisoryServer, npm_package: Path
) -> None:
    done = deps_audit("--osv-url", advisories.osv_url, "--npm-registry", advisories.registry, "--npm-dir", npm_package)
    pins = locked_pins(REPO / "requirements" / "all.txt")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f"deps-audit: python: {len(pins)} locked packages (requirements/all.txt) checked against {advisories.osv_url}",
        f"deps-audit: npm: 1 runtime packages of {npm_package}/package-lock.json checked (npm audit --omit=dev,"
        f" {advisories.registry})",
        "deps-audit: no known vulnerability",
    ]
    assert set(advisories.asked) == {*pins.items(), ("left-pad", "1.3.0")}


def test_a_known_vulnerability_fails_until_reviewed_and_an_expired_review_fails(
    advisories: AdvisoryServer, npm_package: Path, tmp_path: Path
) -> None:
    advisories.osv[("setuptools", SETUPTOOLS)] = [
        osv_record("PYSEC-2026-9001", "setuptools", fixed="999.0", aliases=("GHSA-test-0001-0001",))
    ]
    advisories.npm["left-pad"] = [npm_advisory(1099001, "GHSA-test-0002-0002", title="ReDoS", vulnerable="<=1.3.0")]
    where = ["--requirements", BUILD, "--osv-url", advisories.osv_url, "--npm-registry", advisories.registry]
    where += ["--npm-dir", npm_package]

    found = deps_audit(*where)
    assert found.returncode == 1
    assert (
        f"deps-audit: python: setuptools {SETUPTOOLS}: PYSEC-2026-9001 (GHSA-test-0001-0001), fixed in 999.0:"
        " a test advisory for setuptools" in found.stdout.splitlines()
    )
    assert (
        "deps-audit: npm: left-pad 1.3.0: GHSA-test-0002-0002 (npm-advisory-1099001), fixed in no release yet:"
        " ReDoS (<=1.3.0)" in found.stdout.splitlines()
    )
    assert found.stdout.splitlines()[-1].startswith("deps-audit: 2 known vulnerabilities not reviewed: upgrade")

    reviewed = tmp_path / "osv-scanner.toml"  # an alias matches as well as the id
    reviewed.write_text(
        '[[IgnoredVulns]]\nid = "GHSA-test-0001-0001"\nignoreUntil = 2026-12-31\n'
        'reason = "only easy_install is affected; nothing here runs it"\n\n'
        '[[IgnoredVulns]]\nid = "GHSA-test-0002-0002"\nignoreUntil = 2026-12-06\nreason = "test-only package"\n'
    )
    passed = deps_audit(*where, ignore=reviewed)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert (
        f"deps-audit: python: setuptools {SETUPTOOLS}: PYSEC-2026-9001 (GHSA-test-0001-0001): excepted until"
        " 2026-12-31 (only easy_install is affected; nothing here runs it)" in passed.stdout.splitlines()
    )
    assert passed.stdout.splitlines()[-1] == "deps-audit: no known vulnerability but the 2 excepted above"

    later = deps_audit(*where, "--today", "2026-12-07", ignore=reviewed)  # the second review is due
    assert later.returncode == 1
    assert later.stdout.splitlines()[-2:] == [
        "deps-audit: the exception for GHSA-test-0002-0002 in osv-scanner.toml expired on 2026-12-06"
        " (test-only package): review it (fix, or a new ignoreUntil with its reason)",
        f"{REVIEW}: upgrade (make lock LOCK_ARGS='--upgrade-package NAME'), or add a reviewed exception to"
        " osv-scanner.toml (id, ignoreUntil, reason)",
    ]


@pytest.mark.parametrize("outage", ["refused", "silent"])
def test_a_service_that_cannot_be_reached_is_one_line_and_passes(outage: str, npm_package: Path) -> None:
    with refused_port() if outage == "refused" else silent_port() as port:
        url = f"http://127.0.0.1:{port}"
        done = deps_audit(
            "--requirements", BUILD, "--osv-url", f"{url}/v1/query", "--npm-registry", f"{url}/",
            "--npm-dir", npm_package, "--timeout", "1",
        )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    python, npm, verdict = done.stdout.splitlines()
    assert python.startswith(f"deps-audit: python: not scanned: {url}/v1/query cannot be reached (requests.exceptions.")
    assert npm.startswith(f"deps-audit: npm: not scanned: {url}/ cannot be reached (")
    assert verdict == "deps-audit: no known vulnerability in what was scanned (python and npm not scanned)"


def test_a_mirrors_credentials_in_its_url_are_never_shown(advisories: AdvisoryServer, npm_package: Path) -> None:
    """A CI that asks a private mirror puts its credentials in the URL: the log shows where, never them."""
    creds = "ci-user:s3cret-pw"
    osv, registry = (u.replace("http://", f"http://{creds}@") for u in (advisories.osv_url, advisories.registry))
    where = ["--requirements", BUILD, "--npm-dir", npm_package]
    scanned = deps_audit(*where, "--osv-url", osv, "--npm-registry", registry)
    assert scanned.returncode == 0, scanned.stdout + scanned.stderr
    assert f"checked against {advisories.osv_url}" in scanned.stdout.splitlines()[0]
    assert f"(npm audit --omit=dev, {advisories.registry})" in scanned.stdout.splitlines()[1]
    with refused_port() as port:
        out = f"http://{creds}@127.0.0.1:{port}"
        down = deps_audit(
            *where, "--osv-url", f"{out}/v1/query?key=t0ken", "--npm-registry", f"{out}/", "--timeout", "1"
        )
    assert down.returncode == 0 and f"not scanned: http://127.0.0.1:{port}/v1/query cannot" in down.stdout
    for text in (scanned.stdout, scanned.stderr, down.stdout, down.stderr):
        assert "s3cret" not in text and "ci-user" not in text and "t0ken" not in text, text


def test_a_service_too_slow_to_answer_every_package_in_time_is_one_line_and_passes(
    advisories: AdvisoryServer, npm_package: Path
) -> None:
    advisories.delay = 0.25  # each answer in time, all 139 of them not: 35 s against a 3 s deadline
    where = ["--osv-url", advisories.osv_url, "--npm-registry", advisories.registry, "--npm-dir", npm_package]
    done = deps_audit(*where, "--deadline", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == (
        f"deps-audit: python: not scanned: {advisories.osv_url} did not answer for every package within 3 s"
    )
    # npm has the same 3 s, in which a busy host may not even start it: either way it is not a failure
    assert done.stdout.splitlines()[-1].startswith("deps-audit: no known vulnerability in what was scanned (python ")


def test_an_exception_without_a_reason_or_a_date_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "osv-scanner.toml"
    bad.write_text('[[IgnoredVulns]]\nid = "GHSA-test-0003-0003"\nignoreUntil = 2027-01-31\n')
    done = deps_audit(ignore=bad)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "deps-audit: osv-scanner.toml: IgnoredVulns entry 1 (GHSA-test-0003-0003): no reason"
        " (say why it is safe to ship for now)\n"
    )
    bad.write_text('[[IgnoredVulns]]\nid = "GHSA-test-0003-0003"\nreason = "x"\nignoreUntil = "soon"\n')
    assert deps_audit(ignore=bad).stderr.endswith("ignoreUntil must be a date (ignoreUntil = 2027-01-31)\n")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--osv-url", "api.osv.dev/v1/query"], "argument --osv-url: 'api.osv.dev/v1/query' is not an http(s) URL"),
        (["--npm-registry", "ftp://registry"], "argument --npm-registry: 'ftp://registry' is not an http(s) URL"),
        (["--timeout", "0"], "argument --timeout: '0' is not a positive number of seconds"),
        (["--deadline=-5"], "argument --deadline: '-5' is not a positive number of seconds"),
        (["--npm-dir", "/no/such/dir"], "argument --npm-dir: /no/such/dir is not a directory"),
        (["--requirements", "/no/such/file"], "argument --requirements: /no/such/file is not a file"),
        (["--osv_url", OSV], "unrecognized arguments: --osv_url " + OSV),
    ],
    ids=["url", "registry", "timeout", "deadline", "npm-dir", "requirements", "misspelled"],
)
def test_a_bad_command_line_is_one_line_and_exit_2(args: list[str], said: str) -> None:
    """A typo in a URL or a time would otherwise pass as "not scanned" (exit 0: CI green, nothing scanned),
    and a missing directory was a traceback."""
    done = deps_audit(*args)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"deps-audit: {said}\n")


def test_ci_runs_the_audit_after_the_tests() -> None:
    steps = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("make")]
    assert "make deps-audit" in steps and steps.index("make test") < steps.index("make deps-audit"), steps
    assert (REPO / ".ci" / "run").read_text().count("set -euo pipefail") == 1  # a failing audit fails the run
