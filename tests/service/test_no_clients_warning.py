"""`mrtr-keys serve` with an empty client registry says so at start, with the command that fixes it
(docs/sidecar.md's "run it" block ended in 401 without a word)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e


def test_serve_with_zero_clients_logs_a_warning_naming_the_fix(keystore_path: Path, sidecar_factory: Any) -> None:
    sidecar = sidecar_factory(keystore_path)
    warnings = [line for line in sidecar.output().splitlines() if " WARNING " in line]
    assert len(warnings) == 1, sidecar.output()
    line = warnings[0]
    assert "no sidecar clients in" in line and str(keystore_path.parent / "clients.json") in line
    assert f"mrtr-keys clients add NAME --audience AUDIENCE --keystore {keystore_path}" in line
    secret = sidecar.add_client("web", ["web"])  # picked up without a restart
    assert sidecar.http(secret).post("/v1/seal", json={"audience": "web", "payload": "eA"}).status_code == 200


def test_health_command_answers_for_a_running_sidecar_and_fails_for_none(
    keystore_path: Path, sidecar_factory: Any
) -> None:
    """`mrtr-keys health` (the image's HEALTHCHECK, exec probes): exit 0 with a line, or 1 saying why."""
    from tests.fixtures.common import run_cli
    from tests.support.net import refused_port

    sidecar = sidecar_factory(keystore_path)
    ok = run_cli("health", "--url", sidecar.url)
    assert ok.code == 0 and ok.out == f"ok: {sidecar.url}/healthz answered 200\n"
    ready = run_cli("health", "--ready", "--json", env={"MRTR_KEYS_PORT": sidecar.url.rsplit(":", 1)[1]})
    assert ready.code == 0 and ready.json() == {"url": sidecar.url, "path": "/readyz", "status": 200}
    with refused_port() as port:
        closed = f"http://127.0.0.1:{port}"
        down = run_cli("health", "--url", closed, "--wait", "0.5")
    assert down.code == 1 and down.err == f"mrtr-keys: sidecar at {closed} did not answer /healthz: ConnectError\n"
