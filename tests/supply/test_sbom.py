"""`make sbom` (tools/sbom.py; issue 39, deliverable 3; docs/supply-chain.md): CycloneDX JSON of the locked Python
set and of the TypeScript package, read back against the lockfiles they were made from: every locked package is
a component, with its version, its purl and the hash of every artifact the lock allows, scoped ``required`` if the
image installs it and ``excluded`` if only the tests and tools use it. The Dockerfile side (the image takes these
files in and refuses an SBOM of another lock) is tests/deploy/test_image.py."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.supply.pins import REPO

pytestmark = pytest.mark.e2e

TS_LOCK = REPO / "clients" / "typescript" / "package-lock.json"


def make_sbom(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "sbom.py"), str(out)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def sboms(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], str]:
    out = tmp_path_factory.mktemp("sbom")
    done = make_sbom(out)
    assert done.returncode == 0, done.stderr
    python = json.loads((out / "python.cdx.json").read_text())
    typescript = json.loads((out / "typescript.cdx.json").read_text())
    return python, typescript, done.stdout


def _digest(bom: dict[str, Any]) -> str:
    return next(p["value"] for p in bom["metadata"]["properties"] if p["name"] == "mrtr-keys:lock:sha256")


def test_every_locked_python_package_is_a_component_with_version_purl_and_every_artifact_hash(
    sboms: tuple[dict[str, Any], dict[str, Any], str],
) -> None:
    bom = sboms[0]
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    locked = {p["name"]: p for p in lock["package"] if p["name"] != "mrtr-keys"}
    components = {c["name"]: c for c in bom["components"]}
    assert bom["bomFormat"] == "CycloneDX" and bom["specVersion"] == "1.5"
    assert bom["metadata"]["component"]["name"] == "mrtr-keys" and bom["metadata"]["component"]["version"] == "0.2.0"
    assert set(components) == set(locked)
    for name, package in locked.items():
        component = components[name]
        assert component["version"] == package["version"]
        assert component["purl"] == f"pkg:pypi/{name}@{package['version']}"
        artifacts = [package["sdist"]] if "sdist" in package else []
        artifacts += package.get("wheels", [])
        expected = {(a["url"], a["hash"].removeprefix("sha256:")) for a in artifacts}
        got = {(r["url"], h["content"]) for r in component["externalReferences"] for h in r["hashes"]}
        assert got == expected and expected, name
    assert _digest(bom) == hashlib.sha256((REPO / "uv.lock").read_bytes()).hexdigest()


def test_what_the_image_installs_is_required_and_the_tools_are_excluded(
    sboms: tuple[dict[str, Any], dict[str, Any], str],
) -> None:
    image = {
        line.split("==")[0] for line in (REPO / "requirements" / "image.txt").read_text().splitlines() if "==" in line
    }
    scopes = {c["name"]: c["scope"] for c in sboms[0]["components"]}
    assert {n for n, s in scopes.items() if s == "required"} == image
    assert {"cryptography", "fastapi", "boto3", "hvac", "psycopg"} <= image
    assert {scopes[n] for n in ("pytest", "moto", "pip-audit", "uv", "setuptools")} == {"excluded"}


def test_the_typescript_package_and_its_locked_tree(sboms: tuple[dict[str, Any], dict[str, Any], str]) -> None:
    bom, summary = sboms[1], sboms[2]
    lock = json.loads(TS_LOCK.read_text())["packages"]
    locked = {path.split("node_modules/")[-1]: p for path, p in lock.items() if path}
    assert bom["metadata"]["component"]["name"] == "mrtr-keys"
    assert bom["metadata"]["component"]["purl"] == f"pkg:npm/mrtr-keys@{lock['']['version']}"
    components = {c["name"]: c for c in bom["components"]}
    assert set(components) == set(locked)
    for name, package in locked.items():
        component = components[name]
        assert component["version"] == package["version"]
        assert component["purl"] == f"pkg:npm/{name.replace('@', '%40')}@{package['version']}"
        alg, _, b64 = package["integrity"].partition("-")
        assert component["hashes"] == [{"alg": "SHA-512", "content": base64.b64decode(b64).hex()}] and alg == "sha512"
        assert component["scope"] == "excluded"  # every one is a development dependency: nothing ships with it
    assert _digest(bom) == hashlib.sha256(TS_LOCK.read_bytes()).hexdigest()
    python_line, ts_line = summary.splitlines()
    scopes = [c["scope"] for c in sboms[0]["components"]]
    assert python_line.endswith(
        f"python.cdx.json: {len(scopes)} components ({scopes.count('required')} required,"
        f" {scopes.count('excluded')} excluded), each with version, purl and hashes;"
        f" lockfile sha256 {_digest(sboms[0])[:16]}..."
    )
    assert f"typescript.cdx.json: {len(locked)} components (0 required, {len(locked)} excluded)" in ts_line
