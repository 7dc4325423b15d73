"""A rotation in the middle of a multi-round-trip flow rejects nothing in flight.

Phase 1 (`rotate begin`): every instance learns to verify NEW while OLD still seals. Phase 2
(`rotate promote`): NEW seals and OLD still verifies. During the roll-out of each phase, instances at the
previous phase and the new one serve the same clients, so tokens must cross in both directions.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio

from mrtr_keys.inspection import inspect_token
from mrtr_keys.keystores.file import FileKeystore
from tests.e2e.servers import ServerPool, first_round, retry_round, text_of
from tests.fixtures.common import run_cli


def _kid_of(token: str, keystore: Path) -> str:
    """The kid `mrtr-keys inspect TOKEN --json` reports (its library call, in-process)."""
    return str(inspect_token(FileKeystore(keystore), token)["kid"])


def test_a_round_sealed_at_phase_1_is_finished_by_a_fresh_process_at_phase_2(
    keystore_path: Path, example_servers: ServerPool
) -> None:
    begun = run_cli("rotate", "begin", "--json", keystore=keystore_path)
    assert begun.code == 0, begun.err
    old, new = begun.json()["old"], begun.json()["new"]

    # An instance mid-roll-out: it stays at phase 1 (reload off) while phase 2 is written.
    phase1 = example_servers.start(keystore=keystore_path, instance="phase-1", extra_args=("--reload-every", "0"))
    token_1 = anyio.run(first_round, phase1.url).request_state or ""
    assert _kid_of(token_1, keystore_path) == old  # OLD still seals in phase 1

    promoted = run_cli("rotate", "promote", "--json", keystore=keystore_path)
    assert promoted.code == 0, promoted.err

    phase2 = example_servers.start(keystore=keystore_path, instance="phase-2")
    final = anyio.run(retry_round, phase2.url, token_1, "ap-south-1")
    assert text_of(final) == "Provisioned 'orders' in ap-south-1. (served by phase-2)"

    # The other direction of the same roll-out: a round sealed by the phase-2 process (NEW key)
    # is retried on the phase-1 process, which loaded NEW as verify-only before the promote.
    token_2 = anyio.run(first_round, phase2.url).request_state or ""
    assert _kid_of(token_2, keystore_path) == new
    final = anyio.run(retry_round, phase1.url, token_2, "sa-east-1")
    assert text_of(final) == "Provisioned 'orders' in sa-east-1. (served by phase-1)"
    assert "requestState rejected" not in phase1.output() + phase2.output()


def test_a_running_server_with_reload_every_follows_the_rotation(
    keystore_path: Path, example_servers: ServerPool
) -> None:
    server = example_servers.start(keystore=keystore_path, instance="long-lived", extra_args=("--reload-every", "0.2"))
    assert run_cli("rotate", "begin", keystore=keystore_path).code == 0
    promoted = run_cli("rotate", "promote", "--wait", "30", "--json", keystore=keystore_path)  # once it loaded phase 1
    assert promoted.code == 0, promoted.err

    deadline = time.monotonic() + 20
    while "key ring reloaded: generation 3" not in server.output():
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.1)

    token = anyio.run(first_round, server.url).request_state or ""
    assert _kid_of(token, keystore_path) == promoted.json()["new"]
    assert (
        text_of(anyio.run(retry_round, server.url, token))
        == "Provisioned 'orders' in eu-west-1. (served by long-lived)"
    )
