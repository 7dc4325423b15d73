"""`mrtr-keys serve` with an empty client registry says so at start, with the command that fixes it
(issue 16: docs/sidecar.md's "run it" block ended in 401 without a word)."""

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
