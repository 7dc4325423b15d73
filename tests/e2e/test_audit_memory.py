"""The audit queue is bounded in bytes, not only in events.

A rejected unseal's event keeps the token until the writer fingerprints it. With the store down and
1 MB tokens, a queue bounded only in events grew a sidecar from 94 MB to 1,102 MB RSS over 1,000
unseals. Tokens are now cut to the token cap before queueing and the queue is charged in bytes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.proxy import CountingProxy


def rss_tree_kib(pid: int) -> int:
    """Resident memory (KiB) of `pid` and every descendant (children of all its threads)."""
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            total += int(line.split()[1])
    for tid in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
            total += rss_tree_kib(int(child))
    return total


def test_a_sidecar_with_its_store_down_stays_bounded_under_1_mb_rejected_tokens(
    keystore_path: Path, pg_fault_proxy: tuple[CountingProxy, str], sidecar_factory: Callable[..., Any]
) -> None:
    proxy, url = pg_fault_proxy
    side = sidecar_factory(keystore_path, env={"MRTR_KEYS_AUDIT": url})
    secret = side.add_client("web", ["svc"])
    http = side.http(secret)
    http.timeout = 60
    token = "mk1." + "A" * 1_000_000  # 1 MB, far past the token cap: rejected, and audited
    # encoded once: the sidecar reads and refuses 1 MB a request, the test does not encode it 1,000 times
    body = json.dumps({"audience": "svc", "token": token}).encode()

    def unseal() -> int:
        return http.post("/v1/unseal", content=body, headers={"content-type": "application/json"}).status_code

    assert unseal() == 400
    proxy.stop()  # the audit store is down from here on
    for _ in range(50):  # warm-up: allocations, the writer's failure noticed, the queue filled
        assert unseal() == 400
    before = rss_tree_kib(side.proc.pid)
    for _ in range(950):
        assert unseal() == 400
    after = rss_tree_kib(side.proc.pid)
    growth_mb = (after - before) / 1024
    metrics = http.get("/metrics").text
    m = re.search(r"^mrtr_sidecar_audit_dropped_total (\S+)$", metrics, re.M)
    assert m is not None
    dropped = float(m.group(1))
    print(f"RSS {before / 1024:.0f} -> {after / 1024:.0f} MB over 950 unseals of 1 MB tokens; {dropped:.0f} dropped")
    assert growth_mb < 64, f"RSS grew {growth_mb:.0f} MB"
    assert dropped > 0  # the store is down: the queue filled up to its byte bound, then dropped (counted)
