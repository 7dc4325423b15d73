"""Part 5: wall time of ``mrtr-keys --help`` and ``mrtr-keys rotate status`` (a CLI run in every deploy).

With hyperfine installed (Debian package ``hyperfine``) each round is one hyperfine call
over the three commands (``-N``: no shell in between, after warm-up runs); without it,
the same commands are timed with `subprocess.run`. Rounds are repeated and the medians
of the round medians reported. Anchor: ``python -c pass`` with the same interpreter
(the start-up floor every Python CLI pays).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import Settings
from bench.report import Row, spread_of
from bench.services import Services
from bench.timing import paired_ratio

PART = "cli_time"


def _entry() -> str:
    script = Path(sys.executable).parent / "mrtr-keys"
    return str(script) if script.exists() else "mrtr-keys"


def _hyperfine(hf: str, commands: dict[str, list[str]], runs: int, env: dict[str, str], tmp: Path) -> dict[str, float]:
    out = tmp / "hyperfine.json"
    cmd = [hf, "-N", "--warmup", "2", "--runs", str(runs), "--export-json", str(out), "--style", "none"]
    cmd += [" ".join(c) for c in commands.values()]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = json.loads(out.read_text())["results"]
    return {name: float(res["median"]) for name, res in zip(commands, results, strict=True)}


def _subprocess(commands: dict[str, list[str]], runs: int, env: dict[str, str]) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in commands}
    for i in range(runs + 2):
        for name, cmd in commands.items():
            start = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if i >= 2:  # the first two runs warm the page cache
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run(services: Services, settings: Settings) -> list[Row]:
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.keystores.file import FileKeystore

    ring = services.workdir / "cli-ring.json"
    create_ring(FileKeystore(ring))
    env = {**os.environ, "MRTR_KEYS_KEYSTORE": str(ring)}
    entry = _entry()
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "mrtr-keys --help": [entry, "--help"],
        "mrtr-keys rotate status": [entry, "rotate", "status"],
    }
    subprocess.run(commands["mrtr-keys rotate status"], env=env, check=True, capture_output=True)
    hf = shutil.which("hyperfine")
    rounds = 3
    per_round = max(2, settings.cli_runs // rounds)
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        got = (
            _hyperfine(hf, commands, per_round, env, services.workdir) if hf else _subprocess(commands, per_round, env)
        )
        for name, value in got.items():
            samples[name].append(value)
    tool = "hyperfine -N" if hf else "subprocess.run (hyperfine not installed)"
    rows = []
    anchor = samples["python -c pass"]
    rows.append(Row(PART, "python -c pass", "s", statistics.median(anchor), spread_of(anchor), note=tool))
    for name in ("mrtr-keys --help", "mrtr-keys rotate status"):
        s = samples[name]
        row = Row(PART, name, "s", statistics.median(s), spread_of(s), "python -c pass", paired_ratio(s, anchor))
        row.note = f"{rounds} rounds x {per_round} runs, {tool}"
        if name == "mrtr-keys --help":
            row.decide(row.median, "< 0.3 s")
        rows.append(row)
    return rows
