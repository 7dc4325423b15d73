"""A traffic driver for fleet tests: multi-round flows sent continuously, the retry always on another instance.

`Traffic` runs in a background thread, one turn every `pace` seconds. Each MCP flow calls ``provision`` on one
example server (round 1, an `InputRequiredResult` with a sealed ``requestState``), holds the token for `hold`
seconds (so tokens are in flight across phase changes), then retries on a *different* server. Each sidecar
flow seals on one sidecar and unseals on the other, also after `hold`. Instances are named; only those in
`up_mcp` / `up_sidecars` get traffic, so a test takes one out (`take_out`) before it stops or kills it.

`rounds` counts completed flows, `rejected` the retries refused as invalid requestState (-32602, or the
sidecar's 400), `failed` anything else (connection errors, 5xx); `log` says which and where.
"""

from __future__ import annotations

import base64
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import anyio
import httpx
from mcp.shared.exceptions import MCPError

from tests.e2e.servers import first_round, retry_round, text_of
from tests.support import tls


@dataclass
class Traffic:
    mcp: dict[str, str]
    """Instance name -> MCP URL."""
    sidecars: dict[str, str]
    """Instance name -> sidecar base URL."""
    secret: str
    audience: str = "provisioner"
    hold: float = 0.3
    pace: float = 0.5
    """Seconds between the starts of two turns (each turn begins at most one flow of each kind): a steady two
    flows a second per kind keeps tokens in flight across every phase change (hundreds of rounds in a fleet
    test) without spending the machine on a flood (an unpaced driver kept a core busy for the whole test)."""
    sidecar_flows: int = 1
    """Sidecar flows begun each turn (cheap HTTP seals: more tokens in flight without more MCP sessions)."""
    up_mcp: set[str] = field(default_factory=set)
    up_sidecars: set[str] = field(default_factory=set)
    rounds: int = 0
    rejected: int = 0
    failed: int = 0
    by_instance: dict[str, int] = field(default_factory=dict)
    """Completed flows each instance took part in (sealing or opening)."""
    log: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _busy: dict[str, int] = field(default_factory=dict)
    _thread: threading.Thread | None = None
    _requeue: list[tuple[float, str, str, object]] = field(default_factory=list)

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=lambda: anyio.run(self._run), name="fleet-traffic", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)

    def take_out(self, name: str, timeout: float = 30.0) -> None:
        """No new rounds to `name`; returns once none is in flight there."""
        with self._lock:
            self.up_mcp.discard(name)
            self.up_sidecars.discard(name)
        deadline = time.monotonic() + timeout
        while self._busy.get(name, 0) and time.monotonic() < deadline:
            time.sleep(0.02)

    def put_in(self, name: str) -> None:
        with self._lock:
            (self.up_mcp if name in self.mcp else self.up_sidecars).add(name)

    def wait_rounds(self, n: int, *, involving: str | None = None, timeout: float = 60.0) -> None:
        """Block until `n` more flows completed (involving instance `involving`, if given)."""
        start = self.by_instance.get(involving, 0) if involving else self.rounds
        deadline = time.monotonic() + timeout
        while (self.by_instance.get(involving, 0) if involving else self.rounds) < start + n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"traffic stalled: {self.summary()}")
            time.sleep(0.05)

    def summary(self) -> str:
        return f"rounds={self.rounds} rejected={self.rejected} failed={self.failed} by_instance={self.by_instance}"

    # -- the loop ------------------------------------------------------------------------------------------

    def _pick(self, pool: set[str], turn: int, avoid: str | None = None) -> str | None:
        with self._lock:
            names = sorted(n for n in pool if n != avoid)
        return names[turn % len(names)] if names else None

    def _enter(self, *names: str) -> None:
        with self._lock:
            for n in names:
                self._busy[n] = self._busy.get(n, 0) + 1

    def _leave(self, *names: str) -> None:
        with self._lock:
            for n in names:
                self._busy[n] -= 1

    def _done(self, *names: str) -> None:
        with self._lock:
            self.rounds += 1
            for n in names:
                self.by_instance[n] = self.by_instance.get(n, 0) + 1

    async def _run(self) -> None:
        pending: deque[tuple[float, str, str, object]] = deque()  # (due, kind, sealer, token)
        http = _Clients(self.sidecars)
        headers = {"authorization": f"Bearer {self.secret}"}
        try:
            for turn in itertools.count():
                if self._stop.is_set():
                    break
                turn_started = time.monotonic()
                while pending and pending[0][0] <= time.monotonic():
                    _, kind, sealer, token = pending.popleft()
                    await self._second_round(turn, kind, sealer, token, http, headers)
                pending.extend(self._requeue)
                self._requeue.clear()
                await self._first_rounds(turn, pending, http, headers)
                await anyio.sleep(max(0.01, turn_started + self.pace - time.monotonic()))
            for _, kind, sealer, token in pending:  # finish what is in flight
                await self._second_round(0, kind, sealer, token, http, headers)
            for _, kind, sealer, _token in self._requeue:
                self._fail(f"no other {kind} instance up for a token sealed by {sealer}")
        finally:
            await http.aclose()

    async def _first_rounds(
        self, turn: int, pending: deque[tuple[float, str, str, object]], http: _Clients, headers: dict[str, str]
    ) -> None:
        due = time.monotonic() + self.hold
        x = self._pick(self.up_mcp, turn)
        if x is not None and self._pick(self.up_mcp, turn, avoid=x) is not None:
            self._enter(x)
            try:
                first = await first_round(self.mcp[x])
                pending.append((due, "mcp", x, first.request_state))
            except Exception as exc:
                self._fail(f"round 1 on {x}: {type(exc).__name__}: {exc}")
            finally:
                self._leave(x)
        for i in range(self.sidecar_flows):
            await self._sidecar_first_round(turn * self.sidecar_flows + i, due, pending, http, headers)

    async def _sidecar_first_round(
        self,
        turn: int,
        due: float,
        pending: deque[tuple[float, str, str, object]],
        http: _Clients,
        headers: dict[str, str],
    ) -> None:
        a = self._pick(self.up_sidecars, turn)
        if a is not None and self._pick(self.up_sidecars, turn, avoid=a) is not None:
            self._enter(a)
            try:
                payload = base64.urlsafe_b64encode(f"flow {turn}".encode()).decode().rstrip("=")
                r = await http[a].post(
                    "/v1/seal", json={"audience": self.audience, "payload": payload}, headers=headers
                )
                if r.status_code == 200:
                    pending.append((due, "sidecar", a, (r.json()["token"], payload)))
                else:
                    self._fail(f"seal on {a}: HTTP {r.status_code} {r.text[:200]}")
            except Exception as exc:
                self._fail(f"seal on {a}: {type(exc).__name__}: {exc}")
            finally:
                self._leave(a)

    async def _second_round(
        self, turn: int, kind: str, sealer: str, token: object, http: _Clients, headers: dict[str, str]
    ) -> None:
        pool = self.up_mcp if kind == "mcp" else self.up_sidecars
        y = self._pick(pool, turn, avoid=sealer)
        if y is None:  # the other one is restarting: keep the token in flight a little longer
            self._requeue.append((time.monotonic() + 0.2, kind, sealer, token))
            return
        self._enter(y)
        try:
            if kind == "mcp":
                try:
                    result = text_of(await retry_round(self.mcp[y], str(token)))
                except MCPError as exc:
                    self._reject(f"retry on {y} of a token sealed by {sealer}: {exc.code} {exc.message}")
                    return
                if not result.startswith("Provisioned 'orders'"):
                    self._fail(f"retry on {y}: unexpected answer {result!r}")
                    return
            else:
                tok, payload = token  # type: ignore[misc]
                r = await http[y].post("/v1/unseal", json={"audience": self.audience, "token": tok}, headers=headers)
                if r.status_code == 400:
                    self._reject(f"unseal on {y} of a token sealed by {sealer}: {r.text[:200]}")
                    return
                if r.status_code != 200 or r.json()["payload"] != payload:
                    self._fail(f"unseal on {y}: HTTP {r.status_code} {r.text[:200]}")
                    return
            self._done(sealer, y)
        except Exception as exc:
            self._fail(f"second round on {y}: {type(exc).__name__}: {exc}")
        finally:
            self._leave(y)

    def _reject(self, what: str) -> None:
        with self._lock:
            self.rejected += 1
            self.log.append(f"{time.strftime('%H:%M:%S')} REJECTED {what}")

    def _fail(self, what: str) -> None:
        with self._lock:
            self.failed += 1
            self.log.append(f"{time.strftime('%H:%M:%S')} FAILED {what}")


class _Clients:
    """One HTTP client per sidecar URL, made on first use (a restarted sidecar has a new port)."""

    def __init__(self, urls: dict[str, str]) -> None:
        self._urls = urls
        self._clients: dict[str, httpx.AsyncClient] = {}

    def __getitem__(self, name: str) -> httpx.AsyncClient:
        url = self._urls[name]
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = httpx.AsyncClient(base_url=url, timeout=15, verify=tls.CONTEXT)
        return client

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
