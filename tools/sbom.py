"""``make sbom``: CycloneDX 1.5 JSON for the locked Python set and the TypeScript package (issue 39, deliverable 3).

* ``python.cdx.json``: ``uv export --format cyclonedx1.5`` of uv.lock, every extra and group: each component with
  its version, purl (``pkg:pypi/NAME@VERSION``) and every artifact the lock allows (sdist and wheels: URL and
  sha256, as ``distribution`` external references), and the dependency graph. What the image and
  ``pip install 'mrtr-keys[all]'`` install (requirements/image.txt) has scope ``required``; the rest (test, lint,
  audit and build tools) ``excluded``, CycloneDX's scope for components used only to build and test.
* ``typescript.cdx.json``: ``npm sbom`` of clients/typescript/package-lock.json: each component with its
  version, purl (``pkg:npm/...``) and the lockfile's sha512 integrity. The package has no runtime dependency (its
  one peer, the MCP SDK, is the user's own), so every component is a development one, scope ``excluded``.

Each document's metadata carries the sha256 of the lockfile it was made from (property
``mrtr-keys:lock:sha256``); the Dockerfile refuses to build with a python.cdx.json of another uv.lock. Exits 1
with one line if a component lacks a version, a purl or a hash, or a tool fails.

``python tools/sbom.py [OUT_DIR]`` (default build/sbom), run with the project's interpreter (its uv is used).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lock import REPO, UV, lock_digest

TS_DIR = REPO / "clients" / "typescript"
DIGEST_PROPERTY = "mrtr-keys:lock:sha256"


class Failed(Exception):
    """A tool failed or a component is incomplete (one line)."""


def _run(argv: list[str], cwd: Path) -> Any:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    except OSError as exc:  # no uv beside the interpreter (a .venv pip's fallback made), no npm
        raise Failed(f"{argv[0]} cannot be run: {exc.strerror}") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()] or ["(no output)"]
        raise Failed(f"{' '.join(argv[:2])} failed: {lines[-1].strip()}")
    return json.loads(done.stdout)


def _names(args: list[str]) -> set[str]:
    bom = _run([str(UV), "export", "--frozen", "--quiet", "--format", "cyclonedx1.5", *args], REPO)
    return {c["name"] for c in bom["components"]}


def _stamp(bom: dict[str, Any], digest: str) -> None:
    properties = bom["metadata"].setdefault("properties", [])
    properties.append({"name": DIGEST_PROPERTY, "value": digest})


def python_bom() -> dict[str, Any]:
    """The CycloneDX document of uv.lock (every extra and group), runtime components scoped ``required``."""
    bom: dict[str, Any] = _run(
        [str(UV), "export", "--frozen", "--quiet", "--format", "cyclonedx1.5", "--all-extras", "--all-groups"], REPO
    )
    runtime = _names(["--extra", "all", "--no-default-groups"])
    for component in bom["components"]:
        component["scope"] = "required" if component["name"] in runtime else "excluded"
    _stamp(bom, lock_digest())
    return bom


def typescript_bom() -> dict[str, Any]:
    """The CycloneDX document of clients/typescript/package-lock.json, development components ``excluded``."""
    npm = shutil.which("npm")
    if npm is None:
        raise Failed("npm is not on PATH (the TypeScript SBOM needs Node 20 or newer)")
    bom: dict[str, Any] = _run([npm, "sbom", "--sbom-format", "cyclonedx", "--package-lock-only"], TS_DIR)
    package = json.loads((TS_DIR / "package.json").read_text())
    bom["metadata"]["component"]["name"] = package["name"]  # npm names the root after its directory
    for component in bom["components"]:
        flags = {p["name"]: p["value"] for p in component.get("properties", [])}
        component["scope"] = "excluded" if flags.get("cdx:npm:package:development") == "true" else "required"
    _stamp(bom, hashlib.sha256((TS_DIR / "package-lock.json").read_bytes()).hexdigest())
    return bom


def incomplete(bom: dict[str, Any]) -> list[str]:
    """Components without a version, a purl or at least one hash (on the component or an artifact of it)."""
    out = []
    for c in bom["components"]:
        hashes = c.get("hashes") or [h for ref in c.get("externalReferences", []) for h in ref.get("hashes", [])]
        if not (c.get("version") and c.get("purl") and hashes):
            out.append(c.get("name", "?"))
    return out


def summary(path: Path, bom: dict[str, Any]) -> str:
    scopes = [c["scope"] for c in bom["components"]]
    digest = next(p["value"] for p in bom["metadata"]["properties"] if p["name"] == DIGEST_PROPERTY)
    return (
        f"{path}: {len(scopes)} components ({scopes.count('required')} required, {scopes.count('excluded')}"
        f" excluded), each with version, purl and hashes; lockfile sha256 {digest[:16]}..."
    )


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else REPO / "build" / "sbom"
    try:
        boms = {"python.cdx.json": python_bom(), "typescript.cdx.json": typescript_bom()}
        for name, bom in boms.items():
            missing = incomplete(bom)
            if missing:
                raise Failed(f"{name}: components without a version, purl or hash: {', '.join(missing)}")
    except Failed as exc:
        print(f"sbom: {exc}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    for name, bom in boms.items():
        (out / name).write_text(json.dumps(bom, indent=2) + "\n")
        print(summary(out / name, bom))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
