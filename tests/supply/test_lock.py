"""The dependency lock (issue 39, deliverable 1; README's Developing section, docs/supply-chain.md).

`.venv` holds exactly the locked set, and `make lint`'s check (`tools/lock.py check`) fails with one line telling
to run `make lock` whenever pyproject.toml, uv.lock, the requirements files exported from it or the Dockerfile's
lock digest disagree. The check runs on a copy of the repository's files, so each case edits only its copy.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.supply.pins import REPO, locked_pins

FILES = ("pyproject.toml", "README.md", "uv.lock", "Dockerfile", "requirements", "tools/lock.py")
HINT = "run 'make lock' and commit what it changes"


def test_the_venv_holds_exactly_the_locked_set() -> None:
    pins = locked_pins(REPO / "requirements" / "all.txt")
    installed = {
        canonicalize_name(d.metadata["Name"]): d.version
        for d in metadata.distributions(path=[p for p in sys.path if p.endswith("site-packages")])
    }
    installed.pop("mrtr-keys")  # the project itself, editable
    assert installed == pins


def _assert_hashed(name: str, text: str) -> None:
    lines = text.splitlines()
    pins = [i for i, line in enumerate(lines) if line and line[0] not in " #"]
    assert pins, name
    for i in pins:
        assert "==" in lines[i] and lines[i + 1].startswith("    --hash=sha256:"), (name, lines[i])


def test_every_locked_requirement_carries_hashes() -> None:
    for name in ("all.txt", "image.txt", "build.txt", "uv.txt"):
        _assert_hashed(name, (REPO / "requirements" / name).read_text())


def test_the_pip_fallback_installs_every_locked_pin_but_uv_itself(tmp_path: Path) -> None:
    """Where uv cannot be installed, the Makefile has pip install the locked set without uv: with uv in it (as
    requirements/all.txt has), pip fails on uv exactly as the bootstrap from requirements/uv.txt just did."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "lock.py"), "fallback"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    (tmp_path / "pip.txt").write_text(done.stdout)
    everything = locked_pins(REPO / "requirements" / "all.txt")
    assert "uv" in everything and set(locked_pins(REPO / "requirements" / "uv.txt")) == {"uv"}
    assert locked_pins(tmp_path / "pip.txt") == {k: v for k, v in everything.items() if k != "uv"}
    _assert_hashed("fallback", done.stdout)
    makefile = (REPO / "Makefile").read_text()
    assert "tools/lock.py fallback > $(VENV)/requirements-pip.txt" in makefile
    assert "--require-hashes -r $(VENV)/requirements-pip.txt" in makefile


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    for name in FILES:
        src, dst = REPO / name, tmp_path / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
    return tmp_path


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "tools" / "lock.py"), "check"], capture_output=True, text=True, timeout=60
    )


def test_the_committed_lock_agrees(copy: Path) -> None:
    done = check(copy)
    assert (done.returncode, done.stderr) == (0, "")
    assert (
        f"ARG UV_LOCK_SHA256={hashlib.sha256((copy / 'uv.lock').read_bytes()).hexdigest()}\n"
        in (copy / "Dockerfile").read_text()
    )


def test_a_dependency_added_without_make_lock_fails_in_one_line(copy: Path) -> None:
    pyproject = copy / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"orjson>=3.9",', '"orjson>=3.9",\n    "pyjwt>=2",', 1))
    done = check(copy)
    assert done.returncode == 1
    assert done.stderr == f"lock: pyproject.toml and uv.lock disagree: {HINT}\n"


def test_a_version_bound_changed_without_make_lock_fails(copy: Path) -> None:
    pyproject = copy / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"cryptography>=42"', '"cryptography>=42,<43"', 1))
    done = check(copy)
    assert (done.returncode, done.stderr) == (1, f"lock: pyproject.toml and uv.lock disagree: {HINT}\n")


def test_make_lock_after_a_dependency_change_writes_what_the_check_accepts(copy: Path) -> None:
    """What ``make lock`` runs (``tools/lock.py write``): a bound raised in pyproject.toml (one the locked version
    meets) is written into uv.lock, nothing else changes, and the exports and the Dockerfile's digest follow, so
    ``make lint``'s check passes again. It asks the registry, as ``make lock`` and a fresh clone's set-up do
    (``uv sync`` downloads the locked set): ``uv lock --offline`` re-resolves every fork of the lock from uv's
    cache, which a machine that has only ever synced does not hold (a fresh machine failed it: 'registry
    packages may only be read from the cache'), so offline it passed only where ``make lock`` had run before."""
    pyproject = copy / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"cryptography>=42"', '"cryptography>=43"', 1))
    assert check(copy).returncode == 1
    done = subprocess.run(
        [sys.executable, str(copy / "tools" / "lock.py"), "write"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    digest = hashlib.sha256((copy / "uv.lock").read_bytes()).hexdigest()
    assert done.stdout == (
        f"uv.lock sha256 {digest}; wrote requirements/all.txt, requirements/image.txt, requirements/build.txt, "
        "requirements/uv.txt and the Dockerfile's UV_LOCK_SHA256\n"
    )
    before = (REPO / "uv.lock").read_text().replace('specifier = ">=42" }', 'specifier = ">=43" }', 1)
    assert (copy / "uv.lock").read_text() == before
    again = check(copy)
    assert (again.returncode, again.stderr) == (0, "")
    assert f"ARG UV_LOCK_SHA256={digest}\n" in (copy / "Dockerfile").read_text()
    assert locked_pins(copy / "requirements" / "all.txt") == locked_pins(REPO / "requirements" / "all.txt")


def test_an_edited_export_or_a_stale_digest_fails(copy: Path) -> None:
    image = copy / "requirements" / "image.txt"
    original = image.read_text()
    image.write_text(original.replace("--hash=sha256:", "--hash=sha256:0", 1))
    assert check(copy).stderr == f"lock: requirements/image.txt is not what uv.lock exports: {HINT}\n"
    image.write_text(original)
    dockerfile = copy / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace("ARG UV_LOCK_SHA256=", "ARG UV_LOCK_SHA256=0", 1))
    done = check(copy)
    assert (done.returncode, done.stderr) == (
        1,
        f"lock: the Dockerfile's UV_LOCK_SHA256 is not uv.lock's sha256: {HINT}\n",
    )


def test_a_venv_without_uv_gets_one_line_from_the_lock_check_and_the_sbom(tmp_path: Path) -> None:
    """What pip's fallback makes: an interpreter with no uv beside it."""
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.symlink_to(sys.executable)
    for tool, said in (("lock.py", "lock: "), ("sbom.py", "sbom: ")):
        args = ["check"] if tool == "lock.py" else [str(tmp_path / "sbom")]
        done = subprocess.run([str(python), str(REPO / "tools" / tool), *args], capture_output=True, text=True)
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(said) and str(tmp_path / "bin" / "uv") in done.stderr
        assert "make lock" not in done.stderr  # it needs uv too: the hint would send one round in circles
