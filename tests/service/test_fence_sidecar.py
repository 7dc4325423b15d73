"""The sidecar fences itself as the library codec does (`mrtr_keys.codecs.fence`, issue 23).

A sidecar that missed a promote (reload off, lease off) opens a token the new key sealed after one look at
the keystore; one whose lease ran out while the ring cannot be read keeps serving on its last good ring and
counts those calls in ``mrtr_sidecar_fenced_out_total``, gives their audit events the reason ``fenced-out``
and says so in its heartbeat (``fleet status``) and in ``/readyz`` (still ready: serving so is by design).
"""

from __future__ import annotations

import time
from pathlib import Path

import mrtr_keys
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.service.clients import add_client
from tests.fixtures.audit import cli
from tests.fixtures.sidecar import start_sidecar

AUD = "svc"


def _ring(tmp_path: Path) -> tuple[FileKeystore, str]:
    store = FileKeystore(tmp_path / "ring" / "keyring.json")
    create_ring(store, audiences=(AUD,))
    _, secret = add_client(store.path.parent / "clients.json", "web", audiences=[AUD], ops=["seal", "unseal"])
    return store, secret


def test_a_sidecar_that_missed_a_promote_opens_the_new_key_after_one_look(tmp_path: Path) -> None:
    store, secret = _ring(tmp_path)
    sidecar = start_sidecar(store.path, workdir=tmp_path / "sc", reload_interval=0)  # reload off, lease off
    try:
        for step in ("begin", "promote"):
            newest = run_step(store, step, force=True).ring.generation
        fleet = mrtr_keys.open_codec(store, audience=AUD, reload_every=0)
        codec = sidecar.codec(AUD, secret)
        assert codec.unseal(fleet.seal(b"new key")) == b"new key"
        assert sidecar.generation(secret) == newest
    finally:
        sidecar.stop()


def test_a_sidecar_whose_lease_ran_out_serves_fenced_out_while_the_ring_cannot_be_read(tmp_path: Path) -> None:
    store, secret = _ring(tmp_path)
    sidecar = start_sidecar(
        store.path,
        workdir=tmp_path / "sc",
        reload_interval=60,
        extra=["--lease", "0.3"],
        env={"MRTR_KEYS_INSTANCE": "sc-fenced"},
    )
    try:
        codec = sidecar.codec(AUD, secret)
        assert codec.unseal(codec.seal(b"warm")) == b"warm"
        assert "fenced_out" not in sidecar.http().get("/readyz").json()
        store.path.rename(store.path.with_name("elsewhere.json"))  # the mount is gone
        time.sleep(0.4)
        for i in range(3):
            assert codec.unseal(codec.seal(b"%d" % i)) == b"%d" % i
        metrics = sidecar.http().get("/metrics").text
        line = next(ln for ln in metrics.splitlines() if ln.startswith("mrtr_sidecar_fenced_out_total"))
        assert float(line.split()[-1]) == 6
        assert "fenced out" in sidecar.output()
        ready = sidecar.http().get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["fenced_out"].startswith("fenced out: served 6 call(s) on the last good ring")
        # The heartbeat carries the fence's note (within its change poll), so `fleet status` shows it.
        deadline = time.monotonic() + 10
        while "sc-fenced: fenced out: served" not in (res := cli("fleet", "status", keystore=store.path)).out:
            assert time.monotonic() < deadline, res.out + res.err
            time.sleep(0.1)
        assert res.code == 0
    finally:
        sidecar.stop()
    reasons = [(e["op"], e["reason"]) for e in cli("audit", "query", "--json", keystore=store.path).json()]
    served = [r for r in reasons if r[0] in ("seal", "unseal")]
    assert served == [("seal", None), ("unseal", None)] + [("seal", "fenced-out"), ("unseal", "fenced-out")] * 3
