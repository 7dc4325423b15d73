"""A Vault transit key taken away from a data-key fleet stops it within one check interval; Vault out of reach
does not (issue 37), on a real OpenBao.

Two instances with ``kek_check_every=1`` reach OpenBao through the fault proxy with the token of a server
policy (encrypt, decrypt, read on the key, as docs/vault.md gives servers): a library codec of this process
and a sidecar. The security team's moves, each undone: the transit key's ``min_decryption_version`` raised past
the version that wrapped the data keys (then lowered again), and the server policy emptied (then restored).
Each time every instance fails closed, and serves again, within one interval + the call's deadline (+ what the
host delayed). Then OpenBao is blackholed (connections held, nothing answered) for 8 s: both serve throughout.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import mrtr_keys
from mrtr_keys.changes.create import create_ring
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import CodecSpec
from tests.fixtures.openbao import OpenBao
from tests.fixtures.sidecar import Sidecar, start_sidecar
from tests.support import tls
from tests.support.lateness import Relay
from tests.support.proxy import CountingProxy
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

AUD = "billing"
EVERY = 1.0
DEADLINE = 1.0  # BAO_CLIENT_TIMEOUT 1 s, no retry


def _readyz(s: Sidecar, strict: bool = False) -> tuple[int, dict[str, Any]]:
    r = httpx.get(f"{s.url}/readyz", params={"strict": "true"} if strict else None, timeout=10, verify=tls.CONTEXT)
    return r.status_code, r.json()


def _serves(codec: Any) -> bool:
    try:
        return bool(codec.unseal(codec.seal(b"probe")) == b"probe")
    except Exception:
        return False


def test_min_decryption_version_and_policy_removal_fail_closed_and_a_blackhole_does_not(
    openbao: OpenBao, transit_key: str, bao_proxy: CountingProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy_name = f"srv-{transit_key}"
    policy = (
        f'path "transit/encrypt/{transit_key}" {{ capabilities = ["update"] }}\n'
        f'path "transit/decrypt/{transit_key}" {{ capabilities = ["update"] }}\n'
        f'path "transit/keys/{transit_key}" {{ capabilities = ["read"] }}\n'
    )
    openbao.api("PUT", f"sys/policies/acl/{policy_name}", {"policy": policy})
    auth = openbao.api("POST", "auth/token/create", {"policies": [policy_name], "ttl": "10m"})["auth"]
    assert isinstance(auth, dict)
    ring = tmp_path / "ring" / "keyring.json"
    for name in list(os.environ):
        if name.startswith(("VAULT_", "BAO_")):
            monkeypatch.delenv(name)
    for name, value in openbao.env().items():  # the deploy role (root) makes the ring, straight to OpenBao
        monkeypatch.setenv(name, value)
    create_ring(FileKeystore(ring), codec=CodecSpec("vault-transit", {"key": transit_key, "mode": "datakey"}))
    env = {
        "BAO_ADDR": bao_proxy.addr,
        "BAO_TOKEN": str(auth["client_token"]),
        "BAO_CLIENT_TIMEOUT": str(DEADLINE),
        "BAO_MAX_RETRIES": "0",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    library = mrtr_keys.request_state_security(ring, audience=AUD, audit=False, kek_check_every=EVERY).codec
    sidecar = start_sidecar(ring, workdir=tmp_path / "sc", extra=("--kek-check-every", "1"), env=env)
    try:
        remote = sidecar.codec(AUD, sidecar.add_client("web", [AUD]))
        until(lambda: _readyz(sidecar)[0] == 200, 30, "the sidecar is ready")
        instances = {"library": library, "sidecar": remote}
        assert all(_serves(codec) for codec in instances.values())  # each has unwrapped its data keys

        def moved(change: Any, *, serving: bool, what: str) -> dict[str, float]:
            with Relay() as relay:
                change()
                t0 = time.monotonic()
                took = {}
                for name, codec in instances.items():  # each one's time is when it was seen (an upper bound)
                    until(lambda c=codec: _serves(c) is serving, 30, f"{name}: {what}", every=0.05)
                    took[name] = time.monotonic() - t0
            bound = EVERY + DEADLINE + relay.overrun + 0.5
            assert max(took.values()) <= bound, (what, took, bound)
            print(f"vault {what}: {', '.join(f'{n} within {t:.2f} s' for n, t in took.items())} (bound {bound:.2f} s)")
            return took

        def configure(**values: int) -> None:
            openbao.api("POST", f"transit/keys/{transit_key}/config", dict(values))

        # min_decryption_version raised past the version that wrapped the data keys (v1), then lowered
        openbao.api("POST", f"transit/keys/{transit_key}/rotate")
        moved(lambda: configure(min_decryption_version=2), serving=False, what="min_decryption_version 2: closed")
        status, doc = _readyz(sidecar)
        assert status == 503 and "is disabled, deleted or denied" in doc["reason"], (doc, sidecar.output()[-4000:])
        assert "HTTP 400" in doc["wrapping_key"]["closed"] and _readyz(sidecar, strict=True)[0] == 503
        assert library.kek.state == "revoked"
        moved(lambda: configure(min_decryption_version=1), serving=True, what="min_decryption_version 1: serving")
        # the sidecar checks each of its codecs (here: the client's audience and readiness's own) on its own
        # cycle; it is ready once every one has seen the key answer (at most an interval after the first)
        until(lambda: _readyz(sidecar, strict=True)[0] == 200, EVERY + DEADLINE + 10, "the sidecar is ready again")

        # the instances' policy removed (403 on decrypt), then restored
        empty = 'path "sys/nothing" { capabilities = ["read"] }\n'
        moved(
            lambda: openbao.api("PUT", f"sys/policies/acl/{policy_name}", {"policy": empty}),
            serving=False,
            what="policy removed: closed",
        )
        assert "HTTP 403" in _readyz(sidecar)[1]["wrapping_key"]["closed"]
        moved(
            lambda: openbao.api("PUT", f"sys/policies/acl/{policy_name}", {"policy": policy}),
            serving=True,
            what="policy restored: serving",
        )
        until(lambda: _readyz(sidecar, strict=True)[0] == 200, EVERY + DEADLINE + 10, "the sidecar is ready again")

        # blackholed for 8 s: an outage, not a revocation; every round is served throughout
        served, failures = [0], []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                for codec in (library, remote):
                    if _serves(codec):
                        served[0] += 1
                    else:
                        failures.append(type(codec).__name__)
                time.sleep(0.05)

        driver = threading.Thread(target=traffic, daemon=True)
        driver.start()
        bao_proxy.faults.blackhole()
        try:
            until(lambda: library.kek.state == "unreachable", 30, "the library codec sees the outage")
            until(lambda: _readyz(sidecar)[1].get("wrapping_key", {}).get("state") == "unreachable", 30, "sidecar")
            assert _readyz(sidecar)[0] == 200 and _readyz(sidecar, strict=True)[0] == 503
            time.sleep(8.0)
        finally:
            bao_proxy.faults.restore()
        until(lambda: library.kek.state == "ok", 30, "checked ok again")
        until(lambda: _readyz(sidecar, strict=True)[0] == 200, 30, "strict readiness again")
        stop.set()
        driver.join(30)
        assert failures == [] and served[0] > 50, (failures[:5], served)
        print(f"vault blackholed 8 s: {served[0]} rounds served, {len(failures)} failed")
    finally:
        sidecar.stop()
        if library.kek is not None:
            library.kek.stop()
