"""An instance cut from the keystore during a revoke cannot learn of it (issue 37): ``--wait`` and ``fleet status``
name it, it serves fenced out (by design: availability through a keystore outage), and ``--max-fenced-out``
caps how long.

Three sidecars on one Vault KV ring with presence in PostgreSQL, heartbeats every second (so the self-fencing
lease is 3 s): ``sc-live`` reaches OpenBao directly; ``sc-cut`` and ``sc-capped`` (``--max-fenced-out 2s``)
through the fault proxy, which is stopped before the revoke. Asserted: ``keys revoke --wait 6`` exits 75
naming both cut instances with their notes; ``sc-cut`` keeps sealing under the revoked kid (so ``sc-live``
refuses its tokens: what an uncapped instance risks) and ``sc-capped`` answers 503 once it has served fenced
out for 2 s; ``fleet status`` shows which applied it; once the proxy listens again both load the revocation by
themselves and serve on the new primary.
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import pytest

from tests.e2e.pauses import init_ring, start_sidecar_instance
from tests.fixtures.common import run_cli
from tests.fixtures.openbao import OpenBao
from tests.fixtures.sidecar import Sidecar
from tests.support import tls
from tests.support.proxy import CountingProxy
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

AUD = "provisioner"


def _seal(s: Sidecar, secret: str) -> httpx.Response:
    payload = base64.urlsafe_b64encode(b"round").decode().rstrip("=")
    return httpx.post(
        f"{s.url}/v1/seal",
        json={"audience": AUD, "payload": payload},
        headers={"authorization": f"Bearer {secret}"},
        timeout=10,
        verify=tls.CONTEXT,
    )


def _unseal(s: Sidecar, secret: str, token: str) -> httpx.Response:
    return httpx.post(
        f"{s.url}/v1/unseal",
        json={"audience": AUD, "token": token},
        headers={"authorization": f"Bearer {secret}"},
        timeout=10,
        verify=tls.CONTEXT,
    )


def test_instances_cut_from_the_keystore_are_named_and_a_capped_one_stops_serving(
    openbao: OpenBao, bao_proxy: CountingProxy, tmp_path: Path, postgres_url: str
) -> None:
    ring = f"vault-kv://secret/revoke-cut/{tmp_path.name}"
    env = {
        **openbao.env(),
        "MRTR_KEYS_AUDIT": postgres_url,
        "MRTR_KEYS_STATE_DIR": str(tmp_path / "state"),
        "MRTR_KEYS_KEYSTORE": ring,
    }
    secret = init_ring(ring, env, ttl="60")
    old = run_cli("keys", "list", "--json", keystore=ring, env=env).json()["keys"][0]["kid"]
    through = {**env, "BAO_ADDR": bao_proxy.addr, "BAO_CLIENT_TIMEOUT": "1", "BAO_MAX_RETRIES": "0"}
    sidecars = {
        "sc-live": start_sidecar_instance(ring, env, tmp_path, "sc-live", heartbeat="1", reload=2.0),
        "sc-cut": start_sidecar_instance(ring, through, tmp_path, "sc-cut", heartbeat="1", reload=2.0),
        "sc-capped": start_sidecar_instance(
            ring, through, tmp_path, "sc-capped", "--max-fenced-out", "2s", heartbeat="1", reload=2.0
        ),
    }
    try:
        for s in sidecars.values():
            assert _seal(s, secret).status_code == 200
        bao_proxy.stop()  # the two are cut from OpenBao (connections refused); the audit store still answers
        res = run_cli(
            "keys", "revoke", old, "--reason", "leak", "--yes", "--wait", "6", "--json", keystore=ring, env=env
        )
        assert res.code == 75, res.err
        doc = res.json()
        assert doc["changed"] is True and doc["applied"]["done"] is False
        lagging = {r["name"]: r["note"] or "" for r in doc["applied"]["lagging"]}
        assert set(lagging) == {"sc-cut", "sc-capped"}, lagging
        assert all("keystore" in note or "fenced out" in note for note in lagging.values()), lagging
        assert "sc-cut (generation 1" in res.err and "cannot learn of it" in res.err

        # uncapped: serves fenced out, still sealing under the revoked kid; the live instance refuses that
        token = _seal(sidecars["sc-cut"], secret)
        assert token.status_code == 200 and token.json()["kid"] == old
        refused = _unseal(sidecars["sc-live"], secret, token.json()["token"])
        assert refused.status_code == 400
        # capped: 503 once it has served fenced out for 2 s
        until(lambda: _seal(sidecars["sc-capped"], secret).status_code == 503, 20, "sc-capped refuses", every=0.2)
        assert _unseal(sidecars["sc-capped"], secret, token.json()["token"]).status_code == 503
        assert _seal(sidecars["sc-cut"], secret).status_code == 200  # the default: no cap

        def status() -> str:
            return " ".join(run_cli("fleet", "status", keystore=ring, env=env).out.split())

        until(lambda: "sc-capped: fenced out for" in status(), 10, "the capped one's note (its next heartbeat)")
        text = status()
        assert "over max_fenced_out 2 s: refusing" in text and "sc-cut: fenced out: served" in text, text
        assert f"revoked {old} at" in text and "1 of 3 live instance(s) applied generation 2" in text, text

        bao_proxy.start()  # back: both load the revocation by themselves
        for name in ("sc-cut", "sc-capped"):
            until(lambda n=name: _seal(sidecars[n], secret).json().get("kid") not in (None, old), 20, name)
        fresh = _seal(sidecars["sc-capped"], secret).json()["token"]
        assert _unseal(sidecars["sc-live"], secret, fresh).status_code == 200
        assert _unseal(sidecars["sc-cut"], secret, token.json()["token"]).status_code == 400
        done = run_cli("keys", "revoke", old, "--reason", "leak", "--yes", keystore=ring, env=env)
        assert done.code == 0 and "already revoked" in done.out
        until(
            lambda: all(r["applied"] for r in run_cli("fleet", "status", "--json", keystore=ring, env=env).json()),
            20,
            "every instance applied it",
            every=0.5,
        )
    finally:
        for s in sidecars.values():
            s.stop()
