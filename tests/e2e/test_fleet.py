"""Fleet: round 1 on one server process, the retry on another .

The SDK page (section "保护 requestState") says the default key lives and dies with its process, so a
retry landing on another instance is rejected; a key ring shared by every instance fixes that.
"""

from __future__ import annotations

from pathlib import Path

from tests.e2e.fleet import INVALID_REQUEST_STATE, run_fleet_round_trip
from tests.e2e.servers import SDK_DEFAULT_KEY


def test_a_retry_served_by_another_process_succeeds_with_a_shared_key_ring(keystore_path: Path, tmp_path: Path) -> None:
    result = run_fleet_round_trip(keystore_path, "provisioner", log_dir=tmp_path)

    assert result.request_state.startswith("mk2.")
    assert result.accepted, result.explain()
    assert result.text == "Provisioned 'orders' in eu-west-1. (served by B)"
    assert "requestState rejected" not in result.logs["B"]


def test_the_same_fleet_with_the_sdk_default_key_rejects_the_retry(keystore_path: Path, tmp_path: Path) -> None:
    # Proof the fleet test can fail: each process seals with its own ephemeral key.
    result = run_fleet_round_trip(
        keystore_path, "provisioner", key_args=SDK_DEFAULT_KEY, control=True, log_dir=tmp_path
    )

    assert not result.request_state.startswith("mk2.")
    assert result.error_code_and_message == INVALID_REQUEST_STATE, result.explain()
    assert result.text is None
    assert "requestState rejected on tools/call" in result.logs["B"]
    # The token itself was fine: the process that sealed it still accepts it.
    assert result.control_text == "Provisioned 'orders' in eu-west-1. (served by A)"
