"""The dependency lock and the files made from it (issue 39): ``uv.lock``, ``requirements/*.txt`` and the
Dockerfile's lock digest.

``uv.lock`` (uv's universal lock: every package of every extra and dependency group, each artifact with its
sha256) is the one source. From it, ``write`` exports, each with every hash:

* ``requirements/all.txt``: every extra and group, what ``.venv`` holds; pip installs it when uv cannot be had;
* ``requirements/image.txt``: the project's dependencies with the ``all`` extra, what the image installs;
* ``requirements/build.txt``: the build backend (group ``build``), the image builds the project with it;
* ``requirements/uv.txt``: uv alone (group ``uv``), which the Makefile bootstraps ``.venv`` with;

and writes the lock's sha256 into the Dockerfile (``ARG UV_LOCK_SHA256``: the image's label, and the build's
check that its SBOM and requirements come from this lock).

``python tools/lock.py write [uv lock options]`` (``make lock``): ``uv lock`` (with ``--upgrade`` moves every pin
to the newest release pyproject.toml allows), then the exports and the digest.
``python tools/lock.py check`` (``make lint``): exit 1 with one line naming what disagrees (pyproject.toml and
uv.lock, an export and the lock, the Dockerfile's digest and the lock) and telling to run ``make lock``.
``python tools/lock.py fallback`` (the Makefile, where uv cannot be installed): prints ``requirements/all.txt``
without uv itself (group ``uv``), which is what pip installs then: the same pins and hashes, less the one
package that could not be had (with it, pip would fail on it exactly as the bootstrap did).
Both run the ``uv`` beside the interpreter (the locked one in ``.venv``); ``check`` reads nothing from the
network (``uv lock --check --offline``).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "uv.lock"
DOCKERFILE = REPO / "Dockerfile"
UV = Path(sys.executable).with_name("uv")
HEADER = "# Generated from uv.lock by `make lock` (tools/lock.py); do not edit.\n"
EXPORTS = {
    "requirements/all.txt": ["--all-extras", "--all-groups"],
    "requirements/image.txt": ["--extra", "all", "--no-default-groups"],
    "requirements/build.txt": ["--only-group", "build"],
    "requirements/uv.txt": ["--only-group", "uv"],
}
DIGEST_ARG = re.compile(r"^ARG UV_LOCK_SHA256=(?P<digest>\S*)$", re.M)


class Disagrees(Exception):
    """A generated file does not match the lock, or the lock does not match pyproject.toml."""


class CannotCheck(Exception):
    """There is no uv to check the lock with (`make lock` would not help)."""


def lock_digest() -> str:
    """The sha256 of uv.lock, hex (the image's label ``mrtr-keys.uv-lock.sha256`` and the SBOM's property)."""
    return hashlib.sha256(LOCK.read_bytes()).hexdigest()


def _uv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(UV), *args], cwd=REPO, capture_output=True, text=True, check=False)


def exported(name: str) -> str:
    """The text `name` (a key of EXPORTS) must hold: ``uv export --frozen`` of the lock, hashes included."""
    done = _uv("export", "--frozen", "--quiet", "--no-emit-project", "--format", "requirements.txt", *EXPORTS[name])
    if done.returncode != 0:
        raise Disagrees(f"uv export failed: {_last_line(done.stderr)}")
    return HEADER + done.stdout


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def write(lock_args: list[str]) -> None:
    done = subprocess.run([str(UV), "lock", *lock_args], cwd=REPO, check=False)
    if done.returncode != 0:
        raise SystemExit(done.returncode)
    for name in EXPORTS:
        target = REPO / name
        target.parent.mkdir(exist_ok=True)
        target.write_text(exported(name))
    text = DOCKERFILE.read_text()
    if DIGEST_ARG.search(text) is None:
        raise SystemExit("tools/lock.py: the Dockerfile has no line 'ARG UV_LOCK_SHA256=...' to write the digest to")
    DOCKERFILE.write_text(DIGEST_ARG.sub(f"ARG UV_LOCK_SHA256={lock_digest()}", text))
    print(f"uv.lock sha256 {lock_digest()}; wrote {', '.join(EXPORTS)} and the Dockerfile's UV_LOCK_SHA256")


def fallback(text: str, leave_out: str) -> str:
    """`text` (an export) without the requirements that `leave_out` (another export) names, each with the lines
    of hashes that follow it."""
    names = {_name(line) for line in leave_out.splitlines() if line and line[0] not in " #"}
    kept: list[str] = []
    skipping = False
    for line in text.splitlines(keepends=True):
        if line and line[0] not in " #\n":
            skipping = _name(line) in names
        elif not line.startswith(" "):
            skipping = False
        if not skipping:
            kept.append(line)
    return "".join(kept)


def _name(requirement: str) -> str:
    """The normalised project name a requirement line starts with (PEP 503)."""
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    return re.sub(r"[-_.]+", "-", m.group(0)).lower() if m else requirement


def check() -> None:
    """Raise Disagrees (one line) unless pyproject.toml, uv.lock, the exports and the Dockerfile agree."""
    if not UV.exists():
        raise CannotCheck(f"{UV} is missing (a .venv pip's fallback made): cannot check uv.lock")
    done = _uv("lock", "--check", "--offline")
    if done.returncode != 0:
        raise Disagrees("pyproject.toml and uv.lock disagree")
    for name in EXPORTS:
        path = REPO / name
        if not path.exists() or path.read_text() != exported(name):
            raise Disagrees(f"{name} is not what uv.lock exports")
    found = DIGEST_ARG.search(DOCKERFILE.read_text())
    if found is None or found.group("digest") != lock_digest():
        raise Disagrees("the Dockerfile's UV_LOCK_SHA256 is not uv.lock's sha256")


def main(argv: list[str]) -> int:
    if argv[:1] == ["write"]:
        write(argv[1:])
        return 0
    if argv == ["check"]:
        try:
            check()
        except CannotCheck as exc:
            print(f"lock: {exc}", file=sys.stderr)
            return 1
        except Disagrees as exc:
            print(f"lock: {exc}: run 'make lock' and commit what it changes", file=sys.stderr)
            return 1
        return 0
    if argv == ["fallback"]:
        requirements = REPO / "requirements"
        sys.stdout.write(fallback((requirements / "all.txt").read_text(), (requirements / "uv.txt").read_text()))
        return 0
    print("usage: python tools/lock.py write [uv lock options] | check | fallback", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
