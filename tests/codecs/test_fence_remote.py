"""The self-fencing lease against a remote keystore that is refused, then silent (issue 23).

A library codec over ``vault-kv://`` (OpenBao through a `CountingProxy`) with a short lease. When the
keystore refuses connections, or accepts them and never answers, calls go on being served on the last good
ring, fenced out: at most one call a lease waits for the keystore, and for no longer than the client's
deadline. Once the keystore answers again the lease is renewed and the note is gone.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp.server.mcpserver import InvalidRequestState

import mrtr_keys
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.keystores.vault_kv import VaultKVKeystore
from mrtr_keys.providers.vault.client import VaultClient, VaultSettings
from tests.fixtures.openbao import OpenBao
from tests.support.lateness import Relay
from tests.support.proxy import CountingProxy
from tests.support.waiting import until

AUD = "svc"
LEASE = 0.5


@contextmanager
def _silent(port: int) -> Iterator[None]:
    """While the proxy is stopped: a socket on its port that accepts connections (kernel backlog) and never
    answers, as a hung keystore does."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    try:
        yield
    finally:
        sock.close()


def _served(codec: object, n: int) -> float:
    started = time.monotonic()
    for i in range(n):
        assert codec.unseal(codec.seal(b"%d" % i)) == b"%d" % i  # type: ignore[attr-defined]
    return time.monotonic() - started


def _behind_the_proxy(openbao: OpenBao, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """(the ring's keystore reached directly, a codec with lease `LEASE` reaching it through the proxy that
    `bao_env` names, which has served two calls)."""
    monkeypatch.setenv("MRTR_KEYS_STATE_DIR", str(tmp_path / "state"))
    direct = VaultKVKeystore(
        "secret", f"fence/{tmp_path.name}", client=VaultClient(VaultSettings(addr=openbao.addr, token=openbao.token))
    )
    create_ring(direct, audiences=(AUD,))
    codec = mrtr_keys.open_codec(direct.url, audience=AUD, reload_every=60, lease=LEASE)
    _served(codec, 2)
    return direct, codec


@pytest.mark.parametrize("outage", ["refused", "silent"])
def test_a_keystore_out_of_reach_blocks_one_call_a_lease_for_at_most_its_deadline(
    outage: str,
    openbao: OpenBao,
    bao_env: dict[str, str],
    bao_proxy: CountingProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BAO_CLIENT_TIMEOUT", "1")
    monkeypatch.setenv("BAO_MAX_RETRIES", "0")
    _, codec = _behind_the_proxy(openbao, tmp_path, monkeypatch)
    fence = codec.fence  # type: ignore[attr-defined]
    bao_proxy.stop()
    with _silent(bao_proxy.port) if outage == "silent" else _nothing():
        time.sleep(LEASE + 0.1)
        first = _served(codec, 1)  # the lease ran out: this call looks, and waits for the deadline at most
        rest = _served(codec, 20)  # fenced out: no other call waits within the next lease
        assert fence.error and fence.sync_checks == 1 and fence.fenced_out == 42
        assert first < 3.0 and rest < 0.5, (first, rest)
        assert (fence.note() or "").startswith("fenced out: served")
    bao_proxy.start()
    time.sleep(LEASE + 0.1)
    _served(codec, 1)
    assert fence.error is None and fence.note() is None and fence.sync_checks == 2


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def test_with_the_clients_own_deadlines_a_silent_keystore_holds_a_call_at_most_the_fences_wait(
    openbao: OpenBao, bao_env: dict[str, str], bao_proxy: CountingProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Vault client's defaults (10 s a request, two retries) are for a CLI run, not for a call an MCP server
    makes on its event loop: the fence waits for its keystore check at most `Fence.wait` (1 s), the check goes
    on in the background, and every call meanwhile is served fenced out at once. The unknown-kid look waits no
    longer either (issue 40's chaos run: with OpenBao blackholed, three MCP servers held every round up to 30 s
    a lease, past the clients' 15 s deadline)."""
    direct, codec = _behind_the_proxy(openbao, tmp_path, monkeypatch)
    fence = codec.fence  # type: ignore[attr-defined]
    ahead = mrtr_keys.open_codec(direct, audience=AUD, reload_every=0)
    run_step(direct, "begin", force=True)
    run_step(direct, "promote", force=True)  # the codec behind the proxy never hears of the new key
    ahead.reload()
    unknown = ahead.seal(b"sealed with a key the fenced codec never saw")
    bao_proxy.faults.blackhole()
    try:
        with Relay() as relay:
            time.sleep(LEASE + 0.1)
            first = _served(codec, 1)  # the lease ran out: this call waits for the check, 1 s at most
            rest = _served(codec, 20)  # the check is still out: no call waits
            started = time.monotonic()
            with pytest.raises(InvalidRequestState):
                codec.unseal(unknown)  # one look, 1 s at most, then refused as before
            look = time.monotonic() - started
            late = relay.overrun
        assert first < fence.wait + 0.5 + late and rest < 0.5 + late and look < fence.wait + 0.5 + late
        assert (first, rest, look) > (fence.wait * 0.9, 0.0, fence.wait * 0.9)
        assert fence.error == f"the keystore check did not answer within {fence.wait:g} s" and fence.sync_checks == 1
    finally:
        bao_proxy.faults.restore()
    until(lambda: _served(codec, 1) >= 0 and fence.error is None, 40.0, "the lease renewed once OpenBao answers")
    assert codec.unseal(unknown) == b"sealed with a key the fenced codec never saw"
