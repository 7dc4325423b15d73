"""`mrtr-keys health` is what Kubernetes exec probes and the Docker HEALTHCHECK run every few seconds
(probe timeout 1 s by default): it must not import the MCP SDK (most of its time and a third of its
memory before `sidecar_transport` moved out of `mrtr_keys.codecs.sidecar_client`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import sys
sys.argv = ["mrtr-keys", "health", "--url", "unix:///nonexistent/sidecar.sock", "--timeout", "0.1"]
from mrtr_keys.cli.main import run
try:
    run()
except SystemExit as exc:
    code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"mcp", "fastapi", "uvicorn", "boto3", "hvac", "psycopg"})
print(code, ",".join(heavy) or "-")
"""


@pytest.mark.e2e
def test_health_does_not_import_the_mcp_sdk() -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["1", "-"], (done.stdout, done.stderr)
    assert "did not answer /healthz" in done.stderr
