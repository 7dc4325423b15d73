"""The rotator: ``mrtr-keys rotate next --wait`` again and again, as a deploy pipeline would, the whole run.

Each step is one ``mrtr-keys rotate next --wait 300 --json`` process whose keystore and audit store are
reached through the rotator's own links (a fault on ``all`` reaches it too). `Step` records what each run
said: the step made and the generation it wrote (exit 0), a wait that ran out (75), a lost race
(exit 1, "changed while this run was working": the next run goes on), or anything else (a violation: a
rotation step must never fail otherwise). ``retires`` counts completed rotations.

`force_after_ttl` is for runs shorter than a TTL + 60 s: the retire is forced (``rotate retire --force``)
once ``rotate status`` waits for the TTL alone (every live instance has loaded the promote, no old-key seal
within the TTL) and the TTL itself has passed, skipping only the 60 s clock-skew allowance; it never
skips a gate that protects a round (`tests.e2e.pauses.retire_once_only_time_is_left` does the same).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fixtures.common import run_cli
from tests.support import zygote

from bench.chaos.fleet import REPO

CHANGED = "changed while this run was working"
WAIT = "300"


@dataclass
class Step:
    began: float
    ended: float
    code: int
    step: str | None = None
    generation: int | None = None
    forced: bool = False
    message: str = ""


@dataclass
class Rotator:
    ring: str
    env: dict[str, str]
    log_dir: Path
    force_after_ttl: bool = False
    steps: list[Step] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _proc: Any = None

    @property
    def retires(self) -> int:
        return sum(1 for s in self.steps if s.code == 0 and s.step == "retire")

    @property
    def failures(self) -> list[Step]:
        """Runs that ended otherwise than done, waited out, or lost a race (each is a violation)."""
        return [s for s in self.steps if s.code not in (0, 75) and not (s.code == 1 and CHANGED in s.message)]

    def start(self) -> Rotator:
        self._thread = threading.Thread(target=self._loop, name="chaos-rotator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """No further step; a step waiting on its gates is interrupted (SIGINT: it writes nothing then)."""
        self._stop.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(2)
        if self._thread is not None:
            self._thread.join(60)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.force_after_ttl and self._status().get("next_step") == "retire":
                self._forced_retire()
            else:
                self._run(["rotate", "next", "--wait", WAIT, "--json"])
            self._stop.wait(0.5)

    def _status(self) -> dict[str, Any]:
        res = run_cli("rotate", "status", "--json", env=self.env, timeout=60)
        try:
            doc: dict[str, Any] = json.loads(res.out)
            return doc
        except ValueError:
            return {}

    def _forced_retire(self) -> None:
        while not self._stop.is_set():
            st = self._status()
            if st.get("next_step") != "retire":
                return
            waits = [w.get("for") for w in st.get("waits", [])]
            ready = st.get("instances_ready") == st.get("instances_live")
            if waits == ["TTL"] and ready and float(st.get("wait_seconds") or 0) <= 59.0:
                self._run(["rotate", "retire", "--force", "--json"])
                return
            self._stop.wait(0.5)

    def _run(self, args: list[str]) -> None:
        out, err = self.log_dir / "rotator.out", self.log_dir / "rotator.err"
        argv = [sys.executable, "-m", "mrtr_keys.cli.main", *args]
        began = time.time()
        with out.open("w") as o, err.open("w") as e:
            proc = zygote.popen(argv, stdout=o, stderr=e, env=self.env, cwd=REPO) or subprocess.Popen(
                argv, stdout=o, stderr=e, env=self.env, cwd=REPO
            )
            self._proc = proc
            code = proc.wait()
        self._proc = None
        text, message = out.read_text(), err.read_text().strip()
        with (self.log_dir / "rotator.log").open("a") as log:
            stamp = time.strftime("%H:%M:%S", time.gmtime(began))
            log.write(f"{stamp} mrtr-keys {' '.join(args)} -> exit {code}\n{text}{message}\n")
        step = Step(began, time.time(), code, message=message[-500:], forced="--force" in args)
        try:
            doc = json.loads(text)
            step.step, step.generation = doc.get("step"), doc.get("generation")
            step.message = str(doc.get("message") or doc.get("error") or step.message)[:500]
        except ValueError:
            pass
        if self._stop.is_set() and code != 0:
            return  # interrupted at the end of the run: not a step
        self.steps.append(step)
        if code not in (0, 75):
            time.sleep(1.0)
