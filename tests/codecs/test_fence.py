"""Self-fencing (`mrtr_keys.codecs.fence`) as a library codec from `mrtr_keys.open_codec` shows it.

Rules under test (issue 23): a codec whose lease ran out (it slept through a rotation) checks the keystore
before it serves, so it never seals with a kid the fleet retired meanwhile; with the lease off it does (the
control); a keystore that cannot be reached leaves the codec serving on its last good ring, fenced out,
blocking at most one call a lease on the keystore; an unseal that meets an unknown kid looks at the keystore
once and opens the token if the ring changed, and a flood of forged kids costs at most a look a second.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
from mcp.server.mcpserver import InvalidRequestState
from prometheus_client import REGISTRY

import mrtr_keys
from mrtr_keys.backends import Codec
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs import fence as fence_module
from mrtr_keys.codecs.aesgcm import TOKEN_PREFIX
from mrtr_keys.fleet import instances
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.token import KID_BYTES, b64u_decode, b64u_encode
from tests.fixtures.audit import cli

AUD = "svc"
LEASE = 0.3


def _ring(tmp_path: Path) -> FileKeystore:
    store = FileKeystore(tmp_path / "ring" / "keyring.json")
    create_ring(store, audiences=(AUD,), ttl=60)
    return store


def _rotate(store: FileKeystore) -> int:
    """begin, promote and a forced retire: the old primary is retired when this returns."""
    for step in ("begin", "promote", "retire"):
        ring = run_step(store, step, force=True).ring
    return ring.generation


def _open(store: FileKeystore, **options: object) -> Codec:
    options.setdefault("reload_every", 60)  # the watcher does not tick during a test: the fence must act
    return mrtr_keys.open_codec(store, audience=AUD, **options)  # type: ignore[arg-type]


def test_the_lease_is_the_gates_staleness_window() -> None:
    assert fence_module.LIVE_INTERVALS == instances.LIVE_INTERVALS
    assert fence_module.default_lease(10) == 30


def test_an_instance_that_slept_through_a_rotation_looks_before_it_seals(tmp_path: Path) -> None:
    store = _ring(tmp_path)
    paused = _open(store, lease=LEASE)
    paused.unseal(paused.seal(b"warm"))  # loaded and checked: the lease holds
    time.sleep(LEASE + 0.1)  # "paused": no check for longer than the lease
    newest = _rotate(store)
    fleet = _open(store)
    token = paused.seal(b"after the pause")
    assert fleet.unseal(token) == b"after the pause"
    assert paused.generation == newest  # type: ignore[attr-defined]
    assert paused.fence.sync_checks >= 1 and paused.fence.error is None  # type: ignore[attr-defined]


def test_with_the_lease_off_the_same_instance_seals_with_a_retired_kid(tmp_path: Path) -> None:
    store = _ring(tmp_path)
    paused = _open(store, lease=0)
    old = paused.generation  # type: ignore[attr-defined]
    time.sleep(LEASE + 0.1)
    _rotate(store)
    fleet = _open(store)
    token = paused.seal(b"after the pause")
    with pytest.raises(InvalidRequestState, match="retired kid"):
        fleet.unseal(token)
    assert paused.generation == old  # type: ignore[attr-defined]


def test_a_keystore_out_of_reach_serves_the_last_good_ring_fenced_out(tmp_path: Path) -> None:
    """Served, and recorded: the metric, the reason ``fenced-out`` on each ok audit event of those calls,
    and a note in ``fleet status`` (read from presence, while the keystore is out of reach)."""
    from mrtr_keys.audit.capture.observer import observer_for

    store = _ring(tmp_path)
    observer = observer_for(store.path.parent, audience=AUD)  # the audit store beside the ring
    codec = _open(store, lease=LEASE, instance="svc-fenced", observer=observer)
    codec.unseal(codec.seal(b"warm"))
    fence = codec.fence  # type: ignore[attr-defined]
    counted = REGISTRY.get_sample_value("mrtr_keys_fenced_out_total") or 0.0
    hidden = store.path.with_name("elsewhere.json")
    store.path.rename(hidden)  # the mount is gone
    time.sleep(LEASE + 0.05)
    checks = fence.sync_checks
    for i in range(20):
        assert codec.unseal(codec.seal(b"%d" % i)) == b"%d" % i  # served on the last good ring
    assert fence.sync_checks == checks + 1  # one blocked call a lease, not one a call
    assert fence.fenced_out == 40 and fence.error
    assert (fence.note() or "").startswith("fenced out: served 40 call(s) on the last good ring")
    assert REGISTRY.get_sample_value("mrtr_keys_fenced_out_total") == counted + 40
    assert codec.presence.beat()  # type: ignore[attr-defined]
    res = cli("fleet", "status", keystore=store.path)
    assert res.code == 0, res.err
    assert "  svc-fenced: fenced out: served 40 call(s) on the last good ring" in res.out, res.out
    hidden.rename(store.path)
    time.sleep(LEASE + 0.05)
    codec.seal(b"back")
    assert fence.error is None and fence.note() is None
    assert observer is not None and observer.sink.flush(10)
    events = cli("audit", "query", "--json", keystore=store.path).json()
    reasons = [(e["op"], e["reason"]) for e in events if e["op"] in ("seal", "unseal")]
    assert reasons == [("seal", None), ("unseal", None)] + [("seal", "fenced-out"), ("unseal", "fenced-out")] * 20 + [
        ("seal", None)
    ]
    assert len(cli("audit", "query", "--reason", "fenced-out", "--json", keystore=store.path).json()) == 40


def _forged(token: str) -> str:
    raw = b64u_decode(token[len(TOKEN_PREFIX) :])
    return TOKEN_PREFIX + b64u_encode(os.urandom(KID_BYTES) + raw[KID_BYTES:])


def test_an_unknown_kid_looks_at_the_keystore_once_and_opens_the_new_key(tmp_path: Path) -> None:
    store = _ring(tmp_path)
    behind = _open(store, reload_every=0, lease=0)  # missed the promote: reload off, lease off
    assert behind.watcher is None  # type: ignore[attr-defined]
    for step in ("begin", "promote"):
        run_step(store, step, force=True)
    fleet = _open(store)
    assert behind.unseal(fleet.seal(b"new key")) == b"new key"
    fence = behind.fence  # type: ignore[attr-defined]
    assert fence.looks == 1 and behind.generation == fleet.generation  # type: ignore[attr-defined]

    good = fleet.seal(b"x")
    started, checks = time.monotonic(), fence.watcher.checks
    for _ in range(1000):
        with pytest.raises(InvalidRequestState, match="unknown kid"):
            behind.unseal(_forged(good))
    took = time.monotonic() - started
    # at most one keystore check a second (DEFAULT_LOOK_GAP): 2 when the 1,000 fit in a second, as on a quiet
    # host; a busy host that stretches them over more seconds is allowed one more check for each
    assert fence.watcher.checks - checks <= 1 + math.ceil(took), (fence.watcher.checks - checks, took)


def test_max_fenced_out_caps_how_long_an_instance_serves_on_a_ring_it_cannot_check(tmp_path: Path) -> None:
    """Issue 37: an instance cut from the keystore cannot learn of a revocation, so a cautious operator caps how
    long it serves fenced out (``max_fenced_out=``): past it seals raise and unseals are refused (reason
    ``fenced out too long``, counted), until a keystore check succeeds again; without the cap it keeps serving."""
    from mrtr_keys.codecs.fence import FENCED_OUT_TOO_LONG, FencedOutTooLong

    store = _ring(tmp_path)
    capped = _open(store, lease=LEASE, max_fenced_out=0.4)
    uncapped = _open(store, lease=LEASE)
    token = capped.seal(b"before")
    hidden = store.path.with_name("elsewhere.json")
    store.path.rename(hidden)
    time.sleep(LEASE + 0.05)
    assert capped.unseal(token) == b"before" and uncapped.unseal(token) == b"before"  # fenced out, served
    time.sleep(0.45)
    counted = REGISTRY.get_sample_value("mrtr_keys_rejections_total", {"reason": FENCED_OUT_TOO_LONG}) or 0.0
    with pytest.raises(FencedOutTooLong, match=r"fenced out for \d+ s \(max_fenced_out 0.4 s\)"):
        capped.seal(b"x")
    with pytest.raises(InvalidRequestState, match=FENCED_OUT_TOO_LONG):
        capped.unseal(token)
    assert REGISTRY.get_sample_value("mrtr_keys_rejections_total", {"reason": FENCED_OUT_TOO_LONG}) == counted + 1
    assert "over max_fenced_out 0.4 s: refusing" in (capped.fence.note() or "")  # type: ignore[attr-defined]
    assert uncapped.unseal(uncapped.seal(b"y")) == b"y"  # the default: no cap
    hidden.rename(store.path)
    time.sleep(LEASE + 0.05)  # the next call checks again (the lease's retry), finds the keystore, serves
    assert capped.unseal(capped.seal(b"back")) == b"back"
