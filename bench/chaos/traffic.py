"""The chaos clients: crossing multi-round trips, racing retries and a forger, every call recorded.

One event loop in a background thread starts, every `pace` seconds, one flow of each kind, each its own task
(a call to a paused instance waits for its deadline without holding the others up):

* ``mcp``: round 1 (``provision`` without answers, the Python SDK's client over streamable HTTP) on one MCP
  server, the token held `hold` s, round 2 (the answer and the echoed ``requestState``) on another;
* ``sidecar``: ``POST /v1/seal`` on one sidecar, ``POST /v1/unseal`` on another (or the same one, with one);
* one MCP flow in `RACE_EVERY` is a ``race``: round 2 goes to two instances at once, as a client retrying on
  another replica while the first still works, or a thief with a copy; at most one may be served
  (single-use across the fleet);
* the forger, every `pace` seconds: a token whose round 2 was served, presented again on any instance
  (``replay``; its `Round.t_sealed` is when it was first served), or a token with one character, its kid, its
  length or its prefix changed (``mutate``).

Each call ends as a `Round` (times are POSIX seconds): ``ok``, ``rejected`` (-32602 from an MCP server;
400 ``invalid_token`` or 503 ``replay_store_unavailable`` from a sidecar), ``failed`` (anything else:
a connection refused or reset, a deadline, a 5xx) or, for the forger, ``accepted`` (`on_accepted` is told at
once; the checker judges it at the end).
Flows in flight are capped (`MAX_IN_FLIGHT` per kind): a turn whose kind is full starts nothing.
"""

from __future__ import annotations

import base64
import collections
import itertools
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from mcp.shared.exceptions import MCPError
from tests.e2e.servers import first_round, retry_round, text_of

from bench.chaos.fleet import AUDIENCE, Member

CALL_TIMEOUT = 15.0
"""Seconds a client waits for one call before it counts as failed."""
RACE_EVERY = 8
MAX_IN_FLIGHT = 24


@dataclass
class Round:
    """One flow (or one forged call) as the client saw it."""

    kind: str
    """``mcp``, ``sidecar``, ``race``, ``ts``, ``replay`` or ``mutate``."""
    sealer: str
    opener: str | None = None
    t0: float = 0.0
    """Round 1 sent."""
    t_sealed: float | None = None
    """Round 1 answered (the token's age counts from here)."""
    t_open: float | None = None
    """Round 2 (or the forged call) sent."""
    t1: float = 0.0
    """The flow ended."""
    outcome: str = "ok"
    stage: str = "open"
    """Where it ended: ``seal`` (round 1) or ``open`` (round 2, the forged call)."""
    token: str | None = None
    detail: str = ""
    twin: int | None = None
    """``race``: the index of the round with the other copy."""

    @property
    def forged(self) -> bool:
        return self.kind in ("replay", "mutate")


@dataclass
class Traffic:
    """The clients (see the module docstring) over `members` (name -> `Member`, read at every call: a
    restarted member may listen on a new port)."""

    members: dict[str, Member]
    secret: str
    seed: int = 0
    pace: float = 0.5
    hold: float = 0.3
    rounds: list[Round] = field(default_factory=list)
    on_accepted: Callable[[Round], None] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _in_flight: collections.Counter[str] = field(default_factory=collections.Counter)
    _consumed: collections.deque[tuple[str, str, str, float]] = field(
        default_factory=lambda: collections.deque(maxlen=200)
    )
    """(kind, token, the instance that served it, when): tokens spent, for the forger."""
    skipped: int = 0

    def names(self, kind: str) -> list[str]:
        return sorted(n for n, m in self.members.items() if m.kind == kind)

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=lambda: anyio.run(self._run), name="chaos-traffic", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Start no new flow; return once the ones in flight ended (at most a call deadline and a hold)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CALL_TIMEOUT * 2 + 10)

    def summary(self) -> dict[str, int]:
        out: collections.Counter[str] = collections.Counter(f"{r.kind} {r.outcome}" for r in self.rounds)
        return dict(sorted(out.items()))

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        rng = random.Random(self.seed)
        headers = {"authorization": f"Bearer {self.secret}"}
        async with httpx.AsyncClient(timeout=CALL_TIMEOUT, headers=headers) as http:
            async with anyio.create_task_group() as tg:
                for turn in itertools.count():
                    if self._stop.is_set():
                        break
                    started = time.monotonic()
                    mcp, sidecars = self.names("mcp"), self.names("sidecar")
                    if len(mcp) >= 2:
                        race = turn % RACE_EVERY == RACE_EVERY - 1
                        self._spawn(tg, "mcp", self._mcp_flow, mcp, turn, race)
                    if sidecars:
                        self._spawn(tg, "sidecar", self._sidecar_flow, sidecars, turn, http)
                    self._spawn(tg, "forger", self._forge, rng, http)
                    await anyio.sleep(max(0.01, started + self.pace - time.monotonic()))

    def _spawn(self, tg: Any, kind: str, fn: Callable[..., Any], *args: Any) -> None:
        if self._in_flight[kind] >= MAX_IN_FLIGHT:
            self.skipped += 1
            return
        self._in_flight[kind] += 1

        async def run() -> None:
            try:
                await fn(*args)
            finally:
                self._in_flight[kind] -= 1

        tg.start_soon(run)

    def _record(self, r: Round) -> int:
        r.t1 = time.time()
        self.rounds.append(r)
        if r.outcome == "accepted" and self.on_accepted is not None:
            self.on_accepted(r)
        return len(self.rounds) - 1

    @staticmethod
    def _pair(names: list[str], turn: int) -> tuple[str, str]:
        """Round 1's and round 2's instances for `turn`: every ordered pair in turn (the same one with one)."""
        n = len(names)
        a = names[turn % n]
        if n == 1:
            return a, a
        b = names[(turn % n + 1 + (turn // n) % (n - 1)) % n]
        return a, b

    # ------------------------------------------------------------------ MCP flows

    async def _mcp_flow(self, names: list[str], turn: int, race: bool) -> None:
        a, b = self._pair(names, turn)
        r = Round("race" if race else "mcp", a, b, t0=time.time(), stage="seal")
        try:
            with anyio.fail_after(CALL_TIMEOUT):
                first = await first_round(self.members[a].url)
            r.token = first.request_state
        except Exception as exc:
            r.outcome, r.detail = "failed", why(exc)
            self._record(r)
            return
        r.t_sealed, r.stage = time.time(), "open"
        await anyio.sleep(self.hold)
        if not race:
            await self._mcp_open(r)
            self._record(r)
            return
        others = [n for n in names if n != b]
        twin = Round("race", a, others[turn % len(others)], t0=r.t0, t_sealed=r.t_sealed, token=r.token)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._mcp_open, r)
            tg.start_soon(self._mcp_open, twin)
        i = self._record(r)
        r.twin = self._record(twin)
        twin.twin = i
        if r.outcome == twin.outcome == "ok" and self.on_accepted is not None:
            self.on_accepted(twin)

    async def _mcp_open(self, r: Round) -> None:
        assert r.opener is not None
        r.t_open = time.time()
        try:
            with anyio.fail_after(CALL_TIMEOUT):
                text = text_of(await retry_round(self.members[r.opener].url, r.token))
        except MCPError as exc:
            r.outcome, r.detail = "rejected", f"{exc.code} {exc.message}"
            return
        except Exception as exc:
            r.outcome, r.detail = "failed", why(exc)
            return
        if text.startswith("Provisioned 'orders'"):
            r.outcome = "accepted" if r.forged else "ok"
            if r.kind == "mcp" and r.token:
                self._consumed.append(("mcp", r.token, r.opener, time.time()))
        else:
            r.outcome, r.detail = "failed", f"unexpected answer {text[:200]!r}"

    # ------------------------------------------------------------------ sidecar flows

    async def _sidecar_flow(self, names: list[str], turn: int, http: httpx.AsyncClient) -> None:
        a, b = self._pair(names, turn)
        payload = base64.urlsafe_b64encode(os.urandom(24)).decode().rstrip("=")
        r = Round("sidecar", a, b, t0=time.time(), stage="seal")
        try:
            with anyio.fail_after(CALL_TIMEOUT):
                answer = await http.post(
                    self.members[a].base + "/v1/seal", json={"audience": AUDIENCE, "payload": payload}
                )
        except Exception as exc:
            r.outcome, r.detail = "failed", why(exc)
            self._record(r)
            return
        if answer.status_code != 200:
            r.outcome, r.detail = "failed", f"HTTP {answer.status_code} {answer.text[:200]}"
            self._record(r)
            return
        r.token, r.t_sealed, r.stage = answer.json()["token"], time.time(), "open"
        await anyio.sleep(self.hold)
        await self._sidecar_open(r, http, payload)
        self._record(r)

    async def _sidecar_open(self, r: Round, http: httpx.AsyncClient, payload: str | None) -> None:
        assert r.opener is not None
        r.t_open = time.time()
        try:
            with anyio.fail_after(CALL_TIMEOUT):
                answer = await http.post(
                    self.members[r.opener].base + "/v1/unseal", json={"audience": AUDIENCE, "token": r.token}
                )
        except Exception as exc:
            r.outcome, r.detail = "failed", why(exc)
            return
        body = answer.text[:200]
        if answer.status_code == 200:
            if payload is not None and answer.json().get("payload") != payload:
                r.outcome, r.detail = "failed", "unsealed to another payload"
                return
            r.outcome = "accepted" if r.forged else "ok"
            if r.kind == "sidecar" and r.token:
                self._consumed.append(("sidecar", r.token, r.opener, time.time()))
        elif answer.status_code == 400 or (answer.status_code == 503 and "replay_store_unavailable" in body):
            r.outcome, r.detail = "rejected", f"HTTP {answer.status_code} {body}"
        else:
            r.outcome, r.detail = "failed", f"HTTP {answer.status_code} {body}"

    # ------------------------------------------------------------------ the forger

    async def _forge(self, rng: random.Random, http: httpx.AsyncClient) -> None:
        if not self._consumed:
            return
        spent = self._consumed[rng.randrange(len(self._consumed))]
        kind, token, opener, when = spent
        how = "replay" if rng.random() < 0.5 else "mutate"
        if how == "replay":
            self._consumed.remove(spent)  # each token replayed once: one event each
        else:
            token = mutate(token, rng)
        target = rng.choice(self.names(kind))
        r = Round(how, opener, target, t0=time.time(), t_sealed=when, token=token, detail=kind)
        if kind == "mcp":
            await self._mcp_open(r)
        else:
            await self._sidecar_open(r, http, None)
        self._record(r)


def why(exc: BaseException) -> str:
    """`exc` in one line, the innermost error of an exception group (what the client library raised)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:300]


def mutate(token: str, rng: random.Random) -> str:
    """`token` changed the way a forger would: one body character, the kid, the length, or the prefix."""
    prefix, _, rest = token.partition(".")
    way = rng.randrange(5)
    if way == 0 and len(rest) > 12:  # one character of the body
        i = rng.randrange(9, len(rest))
        alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
        new = rng.choice(alphabet.replace(rest[i], ""))
        return f"{prefix}.{rest[:i]}{new}{rest[i + 1 :]}"
    if way == 1:  # another kid
        return f"{prefix}.{os.urandom(6).hex()[: min(8, len(rest))]}{rest[8:]}"
    if way == 2:  # cut short
        return token[: max(1, len(token) - rng.randrange(1, 8))]
    if way == 3:  # longer
        return token + "A" * rng.randrange(1, 6)
    return "mk9." + rest  # an unknown prefix
