"""A silent replay store (issue 22, deliver 2): connections held open, nothing answered.

Each store (Redis, PostgreSQL) sits behind the fault proxy, which blackholes it for 20 s while 16 callers
keep making single-use unseals (each starts its next as soon as one is answered), in library and sidecar
form. Every library `unseal` fails closed (`InvalidRequestState`) and every sidecar unseal answers 503, each
within the documented 1 s deadline plus 0.5 s (`MARGIN`) plus how late a busy host let a woken thread run
meanwhile (`Relay`); the library codec is served again once the store answers.
Meanwhile what does not need the store keeps answering: the library's `seal`, and the sidecar's ``/healthz``
and seals (store calls run in worker threads, never on the event loop; the control: before, one unseal held
the loop for its whole wait, 40 s on PostgreSQL, and ``/healthz`` failed 16 of 19 probes).

The probes are paced (10 a second each) and the unseals wait on the store, so a test costs little CPU
for its 20 s. The strict latency claims (``/healthz`` and seal p99 under a blackhole <= 1.5x the healthy
p99, tens of ms) are measured by the bench part ``faults`` (bench/faults.py) on a quiet host; here the
bounds are what a loaded host (the suite runs six workers on two cores) keeps: nothing ever waits a store
call's 1 s deadline.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.factory import request_state_security
from tests.fixtures.audit import cli
from tests.support import tls
from tests.support.lateness import Relay
from tests.support.proxy import CountingProxy

pytestmark = pytest.mark.e2e
DEADLINE = 1.0
MARGIN = 0.5
"""What an unseal may take past the store's 1 s deadline (issue 22: "within its deadline (+0.5 s)"), on top of
the scheduling delay `Relay` saw meanwhile. Run alone on a loaded host the slowest took 1.02-1.29 s; with
the whole suite on two cores (six workers, 16 caller threads sharing this process's interpreter) 1.77-2.69 s,
the wait for the interpreter and a core, not the store. A store call without its deadline waited 20-40 s."""
SLACK = 1.0
"""For the count of answers: callers start their next unseal as soon as one is answered."""
BLACKHOLE = 20.0
CALLERS = 16
TOKENS = CALLERS * 24
"""Enough for each caller's unseals over the blackhole (one a second at most, refused at the deadline)."""
PACE = 0.1
"""Seconds between two probes of one kind: 10 a second."""


@pytest.fixture
def ring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.json"
    assert cli("init", "--audience", "svc", keystore=path).code == 0
    return path


def _p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98] if len(samples) >= 2 else max(samples)


def _ms(samples: list[float]) -> str:
    return f"p50 {statistics.median(samples) * 1000:.1f} ms, p99 {_p99(samples) * 1000:.1f} ms (n={len(samples)})"


class Probe:
    """Calls `fn` every `pace` s in a thread until `stop`; `samples` are the seconds each call took (`fn`
    raises on a wrong answer, kept in `errors`)."""

    def __init__(self, fn: Callable[[], None], pace: float = PACE) -> None:
        self.fn, self.pace, self.samples, self.errors = fn, pace, [], []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.pace):
            t = time.monotonic()
            try:
                self.fn()
            except Exception as exc:  # reported by the test
                self.errors.append(repr(exc))
            self.samples.append(time.monotonic() - t)

    def take(self) -> list[float]:
        """The samples so far, and start afresh."""
        taken, self.samples = self.samples, []
        return taken

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _callers(call: Callable[[int, str], Any], tokens: list[str], seconds: float) -> list[tuple[Any, float]]:
    """`CALLERS` threads, each calling ``call(i, token)`` with a fresh token as soon as its last call returned,
    for `seconds`; (what each call returned or raised, seconds it took)."""
    answers: list[tuple[Any, float]] = []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def run(i: int) -> None:
        while time.monotonic() < end:
            with lock:
                token = tokens.pop()
            t = time.monotonic()
            try:
                got: Any = call(i, token)
            except Exception as exc:  # the test checks what came back
                got = exc
            with lock:
                answers.append((got, time.monotonic() - t))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(CALLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return answers


def test_a_library_unseal_fails_closed_within_the_deadline_while_the_store_is_silent(
    ring: Path, store_proxy: tuple[str, CountingProxy]
) -> None:
    url, proxy = store_proxy
    codec: Any = request_state_security(ring, audience="svc", audit=False, single_use=url).codec
    tokens = [codec.seal(b"payload") for _ in range(TOKENS + 1)]
    assert codec.unseal(tokens.pop()) == b"payload"  # connected
    spares = [codec.seal(b"payload") for _ in range(50)]  # minted before the outage, never tried

    def seal() -> None:
        codec.seal(b"payload")

    seals = Probe(seal)
    time.sleep(1.0)
    normal_seal = seals.take()
    proxy.faults.blackhole()
    relay = Relay()
    try:
        answers = _callers(lambda _, token: codec.unseal(token), tokens, BLACKHOLE)
    finally:
        proxy.faults.restore()
        seals.stop()
        starved = relay.stop()
    slowest = max(s for _, s in answers)
    print(
        f"{url.split(':')[0]} blackholed {BLACKHOLE:.0f} s, library: {len(answers)} unseals from {CALLERS} callers, "
        f"slowest refused after {slowest:.2f} s (a thread woken by another ran {starved:.2f} s late at most); "
        f"seal {_ms(seals.samples)} (before: {_ms(normal_seal)})"
    )
    assert all(isinstance(got, InvalidRequestState) for got, _ in answers), {type(g).__name__ for g, _ in answers}
    assert len(answers) >= CALLERS * (BLACKHOLE - 1) / (DEADLINE + SLACK)
    assert slowest <= DEADLINE + MARGIN + starved
    assert seals.errors == [] and len(seals.samples) > BLACKHOLE * 5 and _p99(seals.samples) < DEADLINE
    deadline = time.monotonic() + 10
    # Served again without a restart: a token minted before the outage unseals. Each try takes a new one: a try
    # whose write reached the store but whose answer came after the deadline is refused and its token consumed
    # (docs/single-use.md, "Failure modes"), as can happen to the first tries on a busy host.
    while True:
        try:
            assert codec.unseal(spares.pop()) == b"payload"
            break
        except InvalidRequestState:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    codec.guard.store.close()


def test_a_silent_store_delays_only_the_unseals_that_need_it(
    keystore_path: Path, store_proxy: tuple[str, CountingProxy], sidecar_factory: Callable[..., Any]
) -> None:
    url, proxy = store_proxy
    side = sidecar_factory(keystore_path, extra=["--replay-store", url])
    secret = side.add_client("pay", ["svc"])
    http = side.http(secret)
    tokens: list[str] = []
    while len(tokens) < TOKENS + 1:  # in batches: a few requests, not hundreds
        batch = http.post("/v1/seal/batch", json={"items": [{"audience": "svc", "payload": "AAAA"}] * 200})
        tokens += [item["token"] for item in batch.json()["results"]]
    assert http.post("/v1/unseal", json={"audience": "svc", "token": tokens.pop()}).status_code == 200

    def ok(path: str, body: dict[str, str] | None) -> Callable[[], None]:
        c = httpx.Client(
            base_url=side.url, timeout=10, headers={"authorization": f"Bearer {secret}"}, verify=tls.CONTEXT
        )

        def call() -> None:
            r = c.post(path, json=body) if body else c.get(path)
            assert r.status_code == 200, r.status_code

        return call

    health = Probe(ok("/healthz", None))
    seals = Probe(ok("/v1/seal", {"audience": "svc", "payload": "AAAA"}))
    time.sleep(1.0)
    normal_health, normal_seal = health.take(), seals.take()

    # made (and connected) before the blackhole: an httpx client costs ~20 ms of this process's CPU to build
    callers = [side.http(secret) for _ in range(CALLERS)]
    for c in callers:
        assert c.get("/healthz").status_code == 200

    def unseal(i: int, token: str) -> int:
        return int(callers[i].post("/v1/unseal", json={"audience": "svc", "token": token}).status_code)

    proxy.faults.blackhole()
    relay = Relay()
    try:
        answers = _callers(unseal, tokens, BLACKHOLE)
        ready_took = float("inf")
        for _ in range(3):  # the quickest of three: one answer delayed by a busy host is not the probe waiting
            t = time.monotonic()
            ready = httpx.get(f"{side.url}/readyz", timeout=10, verify=tls.CONTEXT)
            ready_took = min(ready_took, time.monotonic() - t)
    finally:
        proxy.faults.restore()
        health.stop()
        seals.stop()
        starved = relay.stop()
    slowest = max(s for _, s in answers)
    print(
        f"{url.split(':')[0]} blackholed {BLACKHOLE:.0f} s, sidecar: {len(answers)} unseals from {CALLERS} callers "
        f"{sorted({str(c) for c, _ in answers})}, slowest {slowest:.2f} s (a thread here woken by another ran "
        f"{starved:.2f} s late at most); /healthz {_ms(health.samples)} "
        f"(before: {_ms(normal_health)}); seal {_ms(seals.samples)} (before: {_ms(normal_seal)}); "
        f"/readyz {ready.status_code} in {ready_took * 1000:.0f} ms"
    )
    assert {c for c, _ in answers} == {503}
    assert len(answers) >= CALLERS * (BLACKHOLE - 1) / (DEADLINE + SLACK)
    assert slowest <= DEADLINE + MARGIN + starved  # the sidecar is another process on the same two cores
    # /readyz waits at most 0.2 s for its ping, never the store's 1 s deadline (the bound has slack for a busy host)
    assert ready.status_code == 503 and "replay" in ready.json()["down"] and ready_took < 1.0
    # milliseconds on a quiet host; never a store call's 1 s: before, one unseal held the loop for its whole wait,
    # so probes and seals queued behind the blocked unseals for seconds
    assert health.errors == [] and seals.errors == []
    assert len(health.samples) > BLACKHOLE * 5 and _p99(health.samples) < DEADLINE
    assert len(seals.samples) > BLACKHOLE * 5 and _p99(seals.samples) < DEADLINE
