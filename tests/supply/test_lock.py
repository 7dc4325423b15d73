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


def test_every_locked_requirement_carries_hashes() -> None:
    for name in ("all.txt", "image.txt", "build.txt", "uv.txt"):
        lines = (REPO / "requirements" / name).read_text().splitlines()
        pins = [i for i, line in enumerate(lines) if line and line[0] not in " #"]
        assert pins, name
        for i in pins:
            assert "==" in lines[i] and lines[i + 1].startswith("    --hash=sha256:"), (name, lines[i])


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
