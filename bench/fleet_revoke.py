"""The ``fleet`` part's revocation rows (``python -m bench fleet_revoke``; issue 37): how fast a revoked key dies
on five instances, and how well ``keys revoke``'s estimate predicts the rounds it breaks.

Five instance processes (`bench.fleet_worker` with a hold: `mrtr_keys.request_state_security` with every
default, each sealing a round every 0.1 s and opening it `HOLD` seconds later, as a user's answer comes back)
share one file key ring and the default SQLite audit store. The bench revokes the primary `REVOKES` times at
random moments of the instances' check cycles, as ``mrtr-keys keys revoke KID --yes`` does (the estimate
counted under the keystore lock just before the write: `mrtr_keys.fleet.revoke_estimate`), and reports:

* the time from the keystore's save to the last instance's heartbeat at the new generation (presence: each
  instance writes one at once when it loads a generation, and refuses the kid from then on), p50 and p99 over
  every revoke (target: p99 <= 3 s at the default 2 s check interval);
* the rounds refused per revoke (the audit log's ``revoked kid`` rejections of that kid) against the
  estimate: the worst relative difference (target: <= 10 %).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import Settings
from bench.report import Row, spread_of
from bench.services import Services

PART = "fleet"
INSTANCES = 5
REVOKES = 5
HOLD = 5.0
"""Seconds each round's token is held before it is opened (the bench's quick run: 2)."""


def run(services: Services, settings: Settings) -> list[Row]:
    from bench.fleet import _percentile, _wait_all, workers
    from mrtr_keys.audit.writing.stores.base import Query
    from mrtr_keys.audit.writing.stores.url import default_url, open_store
    from mrtr_keys.backends import backend_for
    from mrtr_keys.changes.apply import ChangeResult, apply_change
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.changes.revoke import revoke
    from mrtr_keys.fleet.revoke_estimate import estimate
    from mrtr_keys.keystores.file import FileKeystore
    from mrtr_keys.ring.model import KeyRing

    revokes, hold = (2, 2.0) if settings.quick else (REVOKES, HOLD)
    workdir = Path(services.workdir) / "fleet-revoke"
    workdir.mkdir(parents=True, exist_ok=True)
    keystore = FileKeystore(workdir / "keyring.json")
    create_ring(keystore)
    names = {f"revoke-{i}" for i in range(1, INSTANCES + 1)}
    latencies: list[float] = []  # every instance's, every revoke
    slowest: list[float] = []  # the last instance's, per revoke
    pairs: list[tuple[int, int]] = []  # (estimate, refused) per revoke
    counters: list[dict[str, Any]] = []
    with workers(keystore.path, names, counters, str(hold)):
        store = open_store(default_url(workdir))
        rng = random.Random(37)
        try:
            _wait_all(store, names, keystore.load().generation)
            for _ in range(revokes):
                time.sleep(hold + rng.uniform(0.3, 2.3))  # rounds of every age in flight; a random point of the cycle
                kid = keystore.load().primary.kid
                counted: list[int] = []

                def transform(ring: KeyRing, at: Any, kid: str = kid, counted: list[int] = counted) -> ChangeResult:
                    counted.append(estimate(store, ring, kid, at).rounds or 0)
                    return revoke(ring, kid, at, reason="bench", by="bench", backend=backend_for(ring.codec))

                result = apply_change(keystore, "revoke", transform)
                assert result.saved_at is not None
                seen = _wait_all(store, names, result.ring.generation)
                times = [at - result.saved_at for at in seen.values()]
                latencies += times
                slowest.append(max(times))
                time.sleep(hold + 3.0)  # every round the revoked kid sealed has come back
                refused = len(store.query(Query(op="unseal", kid=kid, reason="revoked kid")))
                pairs.append((counted[-1], refused))
        finally:
            store.close()
    errors = [abs(r - e) / e * 100 for e, r in pairs if e]
    opened = sum(c.get("opened", 0) for c in counters)
    name = f"revoke: keystore write -> every one of {INSTANCES} instances at the new generation"
    return [
        Row(
            PART,
            f"{name}, p50",
            "s",
            statistics.median(latencies),
            spread_of(latencies),
            note=f"{revokes} revokes of the primary, {len(latencies)} instance times; tokens held {hold:g} s",
            samples=latencies,
        ),
        Row(PART, f"{name}, p99", "s", _percentile(latencies, 0.99), spread_of(slowest), samples=slowest).decide(
            _percentile(latencies, 0.99), "<= 3 s"
        ),
        Row(
            PART,
            "revoke: rounds refused against keys revoke's estimate, the worst difference (share of the estimate)",
            "%",
            max(errors) if errors else None,
            spread_of(errors),
            note="(estimate, refused) per revoke: "
            + ", ".join(f"({e}, {r})" for e, r in pairs)
            + f"; {opened} rounds opened in all",
            samples=errors,
        ).decide(max(errors) if errors else None, "<= 10 %"),
    ]
