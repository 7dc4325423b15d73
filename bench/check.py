"""``make bench-check [BASE=REV]``: the audit rows of HEAD against a base revision, interleaved in one session.

A guard against a change that makes the audit path slower without anyone noticing (issue 41: the merge of
schema 4 cost two thirds of the batch rate, and the table only said so a week later). It builds the base
revision (default: the commit of docs/performance.md's table, its ``(git REV)``) in a worktree with a venv of
its own, cached under ``.venv/bench-base/REV``; then, in rounds that alternate which side goes first, runs
the same measuring code (`bench/check_probe.py`) with each side's interpreter:

* in-process: local seal+unseal with the audit log on, its flush inside the timed loop (µs, lower is better);
  and off, for the on/off ratio;
* writer: events/s through the writer process into a new SQLite store;
* sidecar: ``wrk`` (c=16, 1 thread, `SECONDS` s a run) against each side's sidecar with the audit log on, seal
  and seal batch(100) (req/s, items/s), and with it off for the on/off ratio.

Absolute rates of the two sides are compared (medians over the rounds), so a writer that slows together with
its own bare insert is still caught. When a row fails, as many rounds again are run and the medians taken
over all of them (a shared host's burst is not a regression). Exit 1 when any audited row of HEAD is still
more than `TOLERANCE` worse than the base's, else 0; the table is printed either way. About 5 minutes on two
cores (10 with the confirming rounds).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "bench" / "check_probe.py"
TOLERANCE = 0.20
"""How much worse than the base a HEAD row may be (a fraction of the base's rate)."""
ROUNDS = 3
SECONDS = 5
INPROCESS_OPS = 20_000
WRITER_EVENTS = 100_000
BATCH = 100


@dataclass
class Row:
    name: str
    unit: str
    higher_is_better: bool
    gated: bool = True
    samples: dict[str, list[float]] = field(default_factory=lambda: {"base": [], "head": []})

    def median(self, side: str) -> float:
        return statistics.median(self.samples[side]) if self.samples[side] else float("nan")

    def change(self) -> float:
        """HEAD against base, as a fraction (+0.10: HEAD 10 % better)."""
        base, head = self.median("base"), self.median("head")
        return (head / base - 1) if self.higher_is_better else (base / head - 1)


def table_revision(docs: Path = ROOT / "docs" / "performance.md") -> str:
    """The commit of docs/performance.md's latest table (its ``(git REV)``)."""
    m = re.search(r"^Run of .*\(git ([0-9a-f]{7,40})\)", docs.read_text(), re.M)
    if m is None:
        raise SystemExit(f"bench-check: no '(git REV)' in {docs}; give BASE=REV")
    return m.group(1)


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def base_python(rev: str) -> Path:
    """The interpreter of a venv with revision `rev` installed (a worktree and venv made once, then reused)."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = ROOT / ".venv" / "bench-base" / sha[:12]
    python = tree / ".venv" / "bin" / "python"
    if not python.exists():
        if not (tree / ".git").exists():
            shutil.rmtree(tree, ignore_errors=True)
            tree.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=True)
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha], check=True)
        print(f"[bench-check] building {sha[:12]} in {tree} (log: {tree}/build.log)", file=sys.stderr, flush=True)
        with open(tree / "build.log", "wb") as log:
            subprocess.run(["make", "-C", str(tree), ".venv/.installed"], check=True, stdout=log, stderr=log)
    return python


def _probe(python: Path, *args: str) -> dict[str, Any]:
    out = subprocess.run([str(python), str(PROBE), *args], check=True, capture_output=True, text=True, timeout=900)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


class _Sidecar:
    """A sidecar started by the probe with one side's interpreter (stopped by `close`)."""

    def __init__(self, python: Path, directory: Path, audit: str) -> None:
        self.proc = subprocess.Popen(
            [str(python), str(PROBE), "sidecar", str(directory), audit],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a sidecar did not start ({directory}/serve.log)")
        info = json.loads(line)
        self.url, self.secret = str(info["url"]), str(info["secret"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def run(base_rev: str, rounds: int, seconds: float, rows: dict[str, Row] | None = None) -> dict[str, Row]:
    """Measure `rounds` interleaved rounds, adding the samples to `rows` (new rows if None)."""
    import base64

    sys.path.insert(0, str(ROOT))
    from bench.check_probe import PAYLOAD
    from bench.sidecar_load import ensure_wrk, lua_script, run_wrk

    wrk = ensure_wrk()
    if wrk is None:
        raise SystemExit("bench-check: wrk is not installed (apt-get install wrk)")
    pythons = {"base": base_python(base_rev), "head": Path(sys.executable)}
    one = {"audience": "bench", "payload": base64.urlsafe_b64encode(PAYLOAD).rstrip(b"=").decode()}
    rows = rows or {
        "inprocess on": Row("local seal+unseal, audit on (flush included)", "µs", False),
        "inprocess off": Row("local seal+unseal, audit off", "µs", False, gated=False),
        "writer": Row("audit writer, SQLite", "ev/s", True),
    }
    scenarios = {
        "seal": ("/v1/seal", one, 1),
        f"seal batch({BATCH})": ("/v1/seal/batch", {"items": [one] * BATCH}, BATCH),
    }
    for label in scenarios:
        unit = "items/s" if scenarios[label][2] > 1 else "req/s"
        rows.setdefault(f"{label} on", Row(f"sidecar {label} c=16, audit on", unit, True))
        rows.setdefault(f"{label} off", Row(f"sidecar {label} c=16, audit off", unit, True, gated=False))
    with tempfile.TemporaryDirectory(prefix="mrtr-bench-check-") as tmp:
        work = Path(tmp)
        sidecars: dict[tuple[str, str], _Sidecar] = {}
        try:
            for side, python in pythons.items():
                for audit in ("on", "off"):
                    sidecars[side, audit] = _Sidecar(python, work / f"sidecar-{side}-{audit}", audit)
            for r in range(rounds):
                order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
                print(f"[bench-check] round {r + 1} of {rounds} ({' then '.join(order)})", file=sys.stderr, flush=True)
                for side in order:
                    got = _probe(pythons[side], "inprocess", str(INPROCESS_OPS), str(work / f"ip-{side}-{r}"))
                    rows["inprocess on"].samples[side].append(got["on_us"])
                    rows["inprocess off"].samples[side].append(got["off_us"])
                for side in order:
                    got = _probe(pythons[side], "writer", str(WRITER_EVENTS), str(work / f"w-{side}-{r}"))
                    rows["writer"].samples[side].append(got["events_per_s"])
                for label, (path, body, items) in scenarios.items():
                    for side in order:
                        for audit in ("on", "off") if r % 2 == 0 else ("off", "on"):
                            s = sidecars[side, audit]
                            auth = {"Authorization": f"Bearer {s.secret}"}
                            script = lua_script(work, f"{side}-{audit}-{items}", body, auth)
                            res = run_wrk(wrk, s.url + path, script, connections=16, seconds=seconds)
                            if res.errors:
                                raise SystemExit(f"bench-check: {res.errors} errors from the {side} sidecar ({audit})")
                            rows[f"{label} {audit}"].samples[side].append(res.rps * items)
        finally:
            for s in sidecars.values():
                s.close()
    return rows


def render(rows: list[Row], base_rev: str, head: str) -> tuple[str, bool]:
    """The table and whether every gated row is within `TOLERANCE`."""
    ok = True
    lines = [
        f"| row | base {base_rev} | HEAD {head} | HEAD vs base | result |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        change = row.change()
        verdict = "info"
        if row.gated:
            verdict = "PASS" if change >= -TOLERANCE else "FAIL"
            ok = ok and verdict == "PASS"
        lines.append(
            f"| {row.name} | {row.median('base'):,.{1 if row.unit == 'µs' else 0}f} {row.unit} "
            f"| {row.median('head'):,.{1 if row.unit == 'µs' else 0}f} {row.unit} | {change:+.0%} | {verdict} |"
        )
    by = {r.name: r for r in rows}
    ratios = []
    for on, off in (
        ("local seal+unseal, audit on (flush included)", "local seal+unseal, audit off"),
        ("sidecar seal c=16, audit on", "sidecar seal c=16, audit off"),
        (f"sidecar seal batch({BATCH}) c=16, audit on", f"sidecar seal batch({BATCH}) c=16, audit off"),
    ):
        a, b = by[on], by[off]
        ratios.append(
            f"{on.split(', audit')[0]}: audit on/off base {a.median('base') / b.median('base'):.2f}x, "
            f"HEAD {a.median('head') / b.median('head'):.2f}x"
        )
    return "\n".join(lines) + "\n\n" + "\n".join(ratios), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.check", description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the base revision (default: the commit of docs/performance.md's table)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"interleaved rounds (default {ROUNDS})")
    parser.add_argument("--seconds", type=float, default=SECONDS, help=f"seconds per wrk run (default {SECONDS})")
    args = parser.parse_args(argv)
    base_rev = args.base or table_revision()
    started = time.monotonic()
    head = _git("rev-parse", "--short=12", "HEAD")
    rows = run(base_rev, args.rounds, args.seconds)
    rounds = args.rounds
    text, ok = render(list(rows.values()), base_rev, head)
    if not ok:
        print(text + "\n\n[bench-check] a row failed: as many rounds again", file=sys.stderr, flush=True)
        rows = run(base_rev, args.rounds, args.seconds, rows)
        rounds *= 2
        text, ok = render(list(rows.values()), base_rev, head)
    print(text)
    print(
        f"\nbench-check: {'PASS' if ok else 'FAIL'} (a row of HEAD more than {TOLERANCE:.0%} worse than the base "
        f"fails; {rounds} interleaved rounds, {time.monotonic() - started:.0f} s)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
