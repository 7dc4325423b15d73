"""A PostgreSQL audit store that flaps under load: nothing stored twice, every event accounted for.

The database sits behind the fault proxy; while a thread records ~500 events a second, the proxy cuts
and restores every connection 10 times (0.3 s down, 0.3 s up) and once resets a connection right after
its ``COMMIT`` went up (the server applied it, the writer never heard). Afterwards `mrtr-keys audit
verify` passes, no ``(writer, seq)`` is stored twice, and ``submitted == stored + dropped`` exactly
(issue 22, deliver 1).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg

from mrtr_keys.audit.sink import AuditSink
from tests.audit.test_resend import flushed
from tests.fixtures.audit import cli
from tests.support.proxy import CountingProxy


def test_ten_flaps_and_a_lost_commit_under_load_store_each_event_once(
    make_sink: Callable[..., AuditSink], pg_fault_proxy: tuple[CountingProxy, str], postgres_url: str
) -> None:
    proxy, url = pg_fault_proxy
    sink = make_sink(url, mode="process")
    submitted = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal submitted
        while not stop.is_set():
            for _ in range(25):
                sink.record("seal", kid="k1", token=f"tok{submitted}")
                submitted += 1
            time.sleep(0.05)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    time.sleep(0.5)
    flapper = proxy.faults.flap(10, down=0.3, up=0.3)
    time.sleep(3.2)
    proxy.faults.reset_after(0, after=b"COMMIT")
    flapper.join(30)
    time.sleep(0.5)
    stop.set()
    loader.join(10)
    assert flushed(sink, 60)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        stored = conn.execute("SELECT COUNT(*) FROM audit_events WHERE op = 'seal'").fetchone()[0]  # type: ignore[index]
        twice = conn.execute(
            "SELECT COUNT(*) FROM (SELECT writer, seq FROM audit_events GROUP BY writer, seq HAVING COUNT(*) > 1) d"
        ).fetchone()[0]  # type: ignore[index]
    result = cli("audit", "verify", "--audit", postgres_url)
    print(
        f"flaps={proxy.faults.flaps} lost-commit resets={proxy.faults.resets} submitted={submitted} "
        f"stored={stored} dropped={sink.dropped} duplicates={twice} verify={result.code}: {result.out.strip()[:120]}"
    )
    assert proxy.faults.flaps == 10
    assert twice == 0
    assert result.code == 0, result.out + result.err
    assert submitted == stored + sink.dropped
