"""An optional backend whose client library is not installed: `mrtr-keys init` says which extra to install
(one line, exit 2), for KMS as for Vault. The libraries are really absent from the child process: a
sitecustomize on PYTHONPATH makes importing them fail, as on a host without the extra."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.common import run_cli

BLOCKER = """
import importlib.abc
import sys

BLOCKED = {blocked!r}


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Absent())
"""


@pytest.mark.parametrize(
    ("blocked", "args", "hint"),
    [
        (
            ("boto3", "botocore"),
            ["--codec", "kms", "--kms-key-id", "arn:aws:kms:us-east-1:111122223333:key/k"],
            "the kms codec needs boto3: pip install 'mrtr-keys[kms]'",
        ),
        (("hvac",), ["--codec", "vault-transit", "--transit-key", "k"], "pip install 'mrtr-keys[vault]'"),
        (
            ("boto3", "botocore"),
            ["--keystore", "aws-sm://mrtr/keyring"],
            "the aws-sm keystore needs boto3: pip install 'mrtr-keys[kms]'",
        ),
    ],
    ids=["kms", "vault", "aws-sm"],
)
def test_init_without_the_backend_library_prints_the_install_hint(
    tmp_path: Path, blocked: tuple[str, ...], args: list[str], hint: str
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(blocked)))
    env = {"PYTHONPATH": str(site), "AWS_REGION": "us-east-1", "BAO_ADDR": "http://127.0.0.1:9"}
    absent = subprocess.run(
        [sys.executable, "-c", f"import {blocked[0]}"], env={**os.environ, **env}, capture_output=True, check=False
    )
    assert absent.returncode == 1 and b"ImportError" in absent.stderr  # really not importable there
    ring = tmp_path / "keyring.json"
    result = run_cli("init", *args, keystore=ring, env=env)
    assert result.code == 2, result.err
    assert hint in result.err
    assert "internal error" not in result.err and "Traceback" not in result.err
    assert result.err.count("\n") == 1
    assert not ring.exists()
