"""What the checker watches while the run goes on, sampled every `every` seconds into `Samples`.

* every member: a sidecar's authenticated ``/readyz`` and ``/readyz?strict=true`` (the generation it serves,
  ``down``, ``reload_error``, the audit sink's status, the fence), an MCP server's ``/chaos/status``
  (`bench.chaos.mcp_server`); a member that does not answer within the probe's deadline is sampled as such;
* the ring's generation in the keystore (read directly, not through a faulty link);
* the presence rows (read directly from PostgreSQL): each instance's generation and note, as ``fleet
  status`` shows them.

Each `Sample` carries the member's pid at the time, so a sample belongs to one process life.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from bench.chaos.fleet import Member

PROBE_TIMEOUT = 1.5


@dataclass
class Sample:
    at: float
    """POSIX time the probe was sent."""
    name: str
    pid: int | None
    status: int | None = None
    """HTTP status (None: no answer within the deadline)."""
    doc: dict[str, Any] = field(default_factory=dict)
    strict: int | None = None
    """A sidecar's ``/readyz?strict=true`` status."""

    @property
    def generation(self) -> int | None:
        value = self.doc.get("generation")
        return int(value) if isinstance(value, int) else None


@dataclass
class Samples:
    members: list[Sample] = field(default_factory=list)
    ring: list[tuple[float, int]] = field(default_factory=list)
    """(time, the ring's generation in the keystore)."""
    presence: list[tuple[float, dict[str, tuple[int | None, str | None, str]]]] = field(default_factory=list)
    """(time, name -> (generation, note, status)) for every instance with a presence row."""

    def ring_generation(self, at: float) -> int | None:
        """The ring's generation as last read at or before `at`."""
        found = None
        for t, gen in self.ring:
            if t > at:
                break
            found = gen
        return found


class Prober:
    """Samples the fleet every `every` seconds in a background thread until `stop`."""

    def __init__(
        self,
        members: dict[str, Member],
        secret: str,
        *,
        ring_generation: Callable[[], int],
        presence: Callable[[], dict[str, tuple[int | None, str | None, str]]],
        every: float = 0.5,
    ) -> None:
        self.members = members
        self.secret = secret
        self.ring_generation = ring_generation
        self.presence = presence
        self.every = every
        self.samples = Samples()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> Prober:
        self._threads = [
            threading.Thread(target=lambda: anyio.run(self._members), name="chaos-probe", daemon=True),
            threading.Thread(target=self._stores, name="chaos-probe-stores", daemon=True),
        ]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _stores(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.samples.ring.append((time.time(), self.ring_generation()))
            except Exception as exc:
                self.errors.append(f"ring: {type(exc).__name__}: {exc}"[:300])
            try:
                at = time.time()
                self.samples.presence.append((at, self.presence()))
            except Exception as exc:
                self.errors.append(f"presence: {type(exc).__name__}: {exc}"[:300])
            self._stop.wait(max(0.05, started + self.every - time.monotonic()))

    async def _members(self) -> None:
        headers = {"authorization": f"Bearer {self.secret}"}
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT, headers=headers) as http:
            while not self._stop.is_set():
                started = time.monotonic()
                async with anyio.create_task_group() as tg:
                    for member in list(self.members.values()):
                        tg.start_soon(self._probe, http, member)
                await anyio.sleep(max(0.05, started + self.every - time.monotonic()))

    async def _probe(self, http: httpx.AsyncClient, member: Member) -> None:
        s = Sample(time.time(), member.name, member.pid)
        if member.killed:
            self.samples.members.append(s)
            return
        try:
            if member.kind == "mcp":
                r = await http.get(member.base + "/chaos/status")
            else:
                r = await http.get(member.base + "/readyz")
                strict = await http.get(member.base + "/readyz", params={"strict": "true"})
                s.strict = strict.status_code
            s.status = r.status_code
            s.doc = r.json()
        except (httpx.HTTPError, ValueError):
            pass
        self.samples.members.append(s)

    def wait_converged(self, names: list[str], timeout: float) -> float | None:
        """Seconds from now until every one of `names` serves the ring's generation (sampling every 0.1 s),
        or None after `timeout` seconds."""
        started = time.time()
        while time.time() - started < timeout:
            gen = self.ring_generation()
            docs = [self._now(self.members[n]) for n in names]
            if all(d is not None and d.get("generation") == gen for d in docs):
                return time.time() - started
            time.sleep(0.1)
        return None

    def _now(self, member: Member) -> dict[str, Any] | None:
        path = "/chaos/status" if member.kind == "mcp" else "/v1/keys"
        try:
            r = httpx.get(member.base + path, timeout=PROBE_TIMEOUT, headers={"authorization": f"Bearer {self.secret}"})
            doc: dict[str, Any] = r.json()
            return doc
        except (httpx.HTTPError, ValueError):
            return None
