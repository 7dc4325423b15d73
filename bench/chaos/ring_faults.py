"""The nemesis's faults on the key ring itself, each a `mrtr-keys` command run as an operator or a CronJob would.

* ``ring_race``: ``rotate next`` and ``audience add race-N`` started at the same moment, racing the rotator
  (and ``audience remove race-(N-1)`` after them, so the scope stays small).
* ``revoke``: ``keys revoke KID --yes`` of a usable key (the primary or the verify key, chosen by the fault's
  own seed): no gates, every instance refuses its tokens from its next reload (`revoked kid`), a revoked
  primary is replaced at once (issue 37).
* ``budget``: the primary's seal budget set just under twice the seals it has made (``keys budget --kid``),
  then ``rotate next --if-used-over 0.5`` as the CronJob of docs/rotation.md runs it: a rotation begun by use
  racing the pipeline's (issue 36).

Each returns a note for the timeline (the kid revoked, the exit codes). Every command must end done (0),
"not now" (75: a gate, the lock, an outage) or with a lost race (1, "changed while this run was working");
anything else is reported as a violation.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.fixtures.common import CliResult, run_cli

from bench.chaos.rotator import CHANGED
from bench.chaos.schedule import Fault

Report = Callable[..., None]


class RingFaults:
    def __init__(self, env: Callable[[], dict[str, str]], report: Report) -> None:
        self.env = env
        self.report = report
        self.races = 0
        self.revoked: list[tuple[float, str]] = []
        """(time its command started, kid) of each revocation tried."""
        self._lock = threading.Lock()

    def _cli(self, *args: str) -> CliResult:
        return run_cli(*args, "--json", env=self.env(), timeout=120)

    def _judge(self, what: str, res: CliResult) -> str:
        if not (res.code in (0, 75) or (res.code == 1 and CHANGED in res.err + res.out)):
            self.report(time.time(), f"{what} exited {res.code}", res.err + res.out)
        return f"{what}: exit {res.code}"

    def run(self, fault: Fault) -> str:
        """The fault's note (see the module docstring)."""
        if fault.kind == "ring_race":
            return self.race()
        if fault.kind == "revoke":
            return self.revoke(fault)
        if fault.kind == "budget":
            return self.budget()
        raise ValueError(f"not a ring fault: {fault.kind}")

    def race(self) -> str:
        with self._lock:
            self.races += 1
            n = self.races
        results: dict[str, CliResult] = {}

        def one(key: str, *args: str) -> None:
            results[key] = self._cli(*args)

        threads = [
            threading.Thread(target=one, args=("rotate next", "rotate", "next")),
            threading.Thread(target=one, args=(f"audience add race-{n}", "audience", "add", f"race-{n}")),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(130)
        if n > 1:
            one(f"audience remove race-{n - 1}", "audience", "remove", f"race-{n - 1}")
        return ", ".join(self._judge(key, res) for key, res in results.items())

    def _keys(self) -> list[dict[str, Any]]:
        res = self._cli("keys", "list")
        try:
            doc = json.loads(res.out)
        except ValueError:
            return []
        rows = doc if isinstance(doc, list) else doc.get("keys", [])
        return [k for k in rows if isinstance(k, dict)]

    def revoke(self, fault: Fault) -> str:
        usable = sorted(k["kid"] for k in self._keys() if k.get("state") in ("primary", "verify"))
        if not usable:
            return "not applied: no usable key listed"
        kid = random.Random(f"{fault.at}").choice(usable)
        started = time.time()
        res = self._cli("keys", "revoke", kid, "--reason", "chaos: a leaked key", "--yes")
        if res.code in (0, 1, 75):  # a lost answer may hide a revocation that was written: count it as made
            self.revoked.append((started, kid))
        return f"revoked {kid}; " + self._judge(f"keys revoke {kid}", res)

    def budget(self) -> str:
        primary = next((k for k in self._keys() if k.get("state") == "primary"), None)
        if primary is None:
            return "not applied: no primary listed"
        kid, seals = str(primary["kid"]), int(primary.get("seals") or 0)
        budget = max(2 * seals - 1, 2)
        lowered = self._cli("keys", "budget", str(budget), "--kid", kid)
        notes = [self._judge(f"keys budget --kid {kid} {budget}", lowered)]
        by_use = self._cli("rotate", "next", "--if-used-over", "0.5")
        notes.append(self._judge("rotate next --if-used-over 0.5", by_use))
        return f"{kid} had {seals} seals; " + ", ".join(notes)
