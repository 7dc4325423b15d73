"""``make bench-check [BASE=REV]``: the audit rows of HEAD against a base revision, interleaved in one session.

A guard against a change that makes the audit path slower without anyone noticing (issue 41: the merge of
schema 4 cost two thirds of the batch rate, and the table only said so a week later). It builds the base
revision (default: the commit of docs/performance.md's table, its ``(git REV)``) in a venv of its own, cached
under ``.venv/bench-base/REV``, from a lock and never by resolving (`base_python`); then, in rounds that
alternate which side goes first, runs the same measuring code (`bench/check_probe.py`) with each side's
interpreter:

* in-process: local seal+unseal with the audit log on, its flush inside the timed loop (µs, lower is better);
  and off, for the on/off ratio;
* writer: events/s through the writer process into a new SQLite store;
* sidecar: ``wrk`` (c=16, 1 thread, `SECONDS` s a run) against each side's sidecar with the audit log on, seal
  and seal batch(100) (req/s, items/s), and with it off for the on/off ratio.

Absolute rates of the two sides are compared (the median over the rounds of each round's HEAD/base ratio), so a
writer that slows together with its own bare insert is still caught. When a row fails, as many rounds again are
run and the median taken over all of them (a shared host's burst is not a regression). Exit 1 when any audited row
of HEAD is still more than `TOLERANCE` worse than the base's, or HEAD's own package fails a probe; else 0, the
table printed either way. What is no regression of HEAD does not fail it (CI runs it, `.ci/run`): a base revision
this clone lacks or that does not build or run, or no ``wrk``, is one line ``bench-check: not checked: ...`` and
exit 0. About 5 minutes on two cores (10 with the confirming rounds).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
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
        """HEAD against base, as a fraction (+0.10: HEAD 10 % better): the median of each round's own ratio
        (the two sides of a round are measured seconds apart), so a burst of the host's load that hits one
        side in one round and the other side's median in another does not add up to a failure."""
        pairs = list(zip(self.samples["base"], self.samples["head"], strict=True))
        ratios = [(h / b) if self.higher_is_better else (b / h) for b, h in pairs]
        return statistics.median(ratios) - 1 if ratios else float("nan")


def table_revision(docs: Path = ROOT / "docs" / "performance.md") -> str:
    """The commit of docs/performance.md's latest table (its ``(git REV)``)."""
    m = re.search(r"^Run of .*\(git ([0-9a-f]{7,40})\)", docs.read_text(), re.M)
    if m is None:
        raise SystemExit(f"bench-check: no '(git REV)' in {docs}; give BASE=REV")
    return m.group(1)


class NotChecked(Exception):
    """The rows cannot be measured for a reason that is no regression of HEAD (no base revision in this clone,
    a base that does not build or run, no ``wrk``): one line, and the check passes."""


class HeadFailed(Exception):
    """HEAD's own package failed a probe (a sidecar that does not start or answers errors): the check fails."""


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def resolve(rev: str) -> str:
    """The full commit id of `rev`.

    Raises:
        NotChecked: this clone does not have it (a shallow clone, a revision of another repository).
    """
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise NotChecked(f"the base revision {rev} is not in this clone (a shallow clone? git fetch --unshallow)")
    return done.stdout.strip()


def _requirements(tree: Path, name: str) -> Path:
    """The base's own export of its lock (`requirements/NAME`), or HEAD's for a base older than the lock."""
    own = tree / "requirements" / name
    return own if own.exists() else ROOT / "requirements" / name


def install_steps(tree: Path, venv: Path) -> list[list[str]]:
    """The commands that make `venv` hold the base in `tree`: its locked runtime set (`requirements/image.txt`)
    and build backend (``build.txt``), every artifact checked against its sha256 (``--require-hashes``, no
    dependency resolved), then the base itself built with that backend (``--no-deps --no-build-isolation``).
    A base older than the lock (95b81a7) takes HEAD's exports. With the ``uv`` beside this interpreter (the
    locked one) when there is one, else pip. The venv's interpreter is the one HEAD's venv was made from."""
    python = venv / "bin" / "python"
    uv = Path(sys.executable).with_name("uv")
    base = getattr(sys, "_base_executable", sys.executable)
    if uv.exists():
        make = [base, "-m", "venv", "--without-pip", str(venv)]
        install = [str(uv), "pip", "install", "--quiet", "--python", str(python)]
    else:
        make = [base, "-m", "venv", str(venv)]
        install = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    image, build = _requirements(tree, "image.txt"), _requirements(tree, "build.txt")
    return [
        make,
        [*install, "--require-hashes", "--no-deps", "-r", str(image), "-r", str(build)],
        [*install, "--no-deps", "--no-build-isolation", str(tree)],
    ]


def base_python(sha: str, cache: Path | None = None) -> Path:
    """The interpreter of a venv with commit `sha` installed (`install_steps`), made once under `cache`
    (default ``.venv/bench-base/``) and then reused; the tree is `sha`'s files (``git archive``).

    Raises:
        NotChecked: the base does not build (its log is named).
    """
    tree = (cache or ROOT / ".venv" / "bench-base") / sha[:12]
    venv = tree / ".venv"
    built = venv / ".bench-check-built"
    if built.exists():
        return venv / "bin" / "python"
    if (tree / ".git").exists():  # a worktree an earlier bench-check made
        shutil.rmtree(tree, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], check=False)
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    log_path = tree.parent / f"{sha[:12]}.build.log"
    print(f"[bench-check] building {sha[:12]} in {tree} (log: {log_path})", file=sys.stderr, flush=True)
    with open(log_path, "wb") as log:
        archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", "--format=tar", sha], stdout=subprocess.PIPE)
        assert archive.stdout is not None
        with tarfile.open(fileobj=archive.stdout, mode="r|") as tar:
            tar.extractall(tree, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))  # type: ignore[arg-type]
        if archive.wait() != 0:
            raise NotChecked(f"git archive {sha[:12]} failed")
        for step in install_steps(tree, venv):
            log.write(f"$ {' '.join(step)}\n".encode())
            log.flush()
            if subprocess.run(step, stdout=log, stderr=log, check=False).returncode != 0:
                raise NotChecked(f"the base {sha[:12]} does not build from its lock (see {log_path})")
    built.touch()
    return venv / "bin" / "python"


def _probe(python: Path, side: str, *args: str) -> dict[str, Any]:
    try:
        out = subprocess.run([str(python), str(PROBE), *args], check=True, capture_output=True, text=True, timeout=900)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        said = getattr(exc, "stderr", None) or ""
        said = said.decode(errors="replace") if isinstance(said, bytes) else str(said)
        last = said.strip().splitlines()[-1] if said.strip() else type(exc).__name__
        raise _failure(side, f"the {args[0]} probe failed: {last}") from None


def _failure(side: str, what: str) -> Exception:
    """A probe of `side` that could not measure: the base's is no regression of HEAD, HEAD's is."""
    return NotChecked(f"base: {what}") if side == "base" else HeadFailed(f"HEAD: {what}")


class _Sidecar:
    """A sidecar started by the probe with one side's interpreter (stopped by `close`)."""

    def __init__(self, python: Path, side: str, directory: Path, audit: str) -> None:
        self.proc = subprocess.Popen(
            [str(python), str(PROBE), "sidecar", str(directory), audit],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = self.proc.stdout.readline()
        try:
            info = json.loads(line)
            self.url, self.secret = str(info["url"]), str(info["secret"])
        except (ValueError, KeyError, TypeError):
            self.proc.kill()
            said = self.proc.stderr.read().strip().splitlines()
            raise _failure(
                side, f"a sidecar (audit {audit}) did not start: {said[-1] if said else 'no output'}"
            ) from None

    def close(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.close()
            self.proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def run(
    pythons: dict[str, Path], wrk: str, rounds: int, seconds: float, rows: dict[str, Row] | None = None
) -> dict[str, Row]:
    """Measure `rounds` interleaved rounds of the ``base`` and ``head`` interpreters in `pythons`, adding the
    samples to `rows` (new rows if None).

    Raises:
        NotChecked: the base could not be measured; HeadFailed: HEAD could not.
    """
    import base64

    sys.path.insert(0, str(ROOT))
    from bench.check_probe import PAYLOAD
    from bench.sidecar_load import lua_script, run_wrk

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
                    sidecars[side, audit] = _Sidecar(python, side, work / f"sidecar-{side}-{audit}", audit)
            for r in range(rounds):
                order = ["base", "head"] if r % 2 == 0 else ["head", "base"]
                print(f"[bench-check] round {r + 1} of {rounds} ({' then '.join(order)})", file=sys.stderr, flush=True)
                for side in order:
                    got = _probe(pythons[side], side, "inprocess", str(INPROCESS_OPS), str(work / f"ip-{side}-{r}"))
                    rows["inprocess on"].samples[side].append(got["on_us"])
                    rows["inprocess off"].samples[side].append(got["off_us"])
                for side in order:
                    got = _probe(pythons[side], side, "writer", str(WRITER_EVENTS), str(work / f"w-{side}-{r}"))
                    rows["writer"].samples[side].append(got["events_per_s"])
                for label, (path, body, items) in scenarios.items():
                    for side in order:
                        for audit in ("on", "off") if r % 2 == 0 else ("off", "on"):
                            s = sidecars[side, audit]
                            auth = {"Authorization": f"Bearer {s.secret}"}
                            script = lua_script(work, f"{side}-{audit}-{items}", body, auth)
                            try:
                                res = run_wrk(wrk, s.url + path, script, connections=16, seconds=seconds)
                            except (RuntimeError, AttributeError, ValueError) as exc:  # wrk itself failed
                                raise NotChecked(f"wrk: {exc}") from None
                            if res.errors:
                                raise _failure(side, f"{res.errors} errors from the sidecar ({label}, audit {audit})")
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
    note = "(HEAD vs base: the median over the rounds of each round's own ratio; the sides' columns: medians)"
    return "\n".join(lines) + "\n" + note + "\n\n" + "\n".join(ratios), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.check", description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the base revision (default: the commit of docs/performance.md's table)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"interleaved rounds (default {ROUNDS})")
    parser.add_argument("--seconds", type=float, default=SECONDS, help=f"seconds per wrk run (default {SECONDS})")
    args = parser.parse_args(argv)
    if args.rounds < 1 or not 0 < args.seconds < 3600:  # no samples: every row's median ratio is NaN, a FAIL
        parser.error("--rounds must be at least 1 and --seconds from 0 to 3600 (not included)")
    base_rev = args.base or table_revision()
    started = time.monotonic()
    head = _git("rev-parse", "--short=12", "HEAD")
    try:
        from bench.sidecar_load import ensure_wrk

        try:
            sha = resolve(base_rev)
        except NotChecked as exc:
            if args.base:  # a revision the caller named: a bad command line, not a missing clone
                print(f"bench-check: {exc}", file=sys.stderr)
                return 2
            raise
        wrk = ensure_wrk()
        if wrk is None:
            raise NotChecked("wrk is not installed (apt-get install wrk)")
        pythons = {"base": base_python(sha), "head": Path(sys.executable)}
        rows = run(pythons, wrk, args.rounds, args.seconds)
        rounds = args.rounds
        text, ok = render(list(rows.values()), base_rev, head)
        if not ok:
            print(text + "\n\n[bench-check] a row failed: as many rounds again", file=sys.stderr, flush=True)
            rows = run(pythons, wrk, args.rounds, args.seconds, rows)
            rounds *= 2
            text, ok = render(list(rows.values()), base_rev, head)
    except NotChecked as exc:
        print(f"bench-check: not checked: {exc}")
        return 0
    except HeadFailed as exc:
        print(f"bench-check: FAIL: {exc}")
        return 1
    print(text)
    print(
        f"\nbench-check: {'PASS' if ok else 'FAIL'} (a row of HEAD more than {TOLERANCE:.0%} worse than the base "
        f"fails; {rounds} interleaved rounds, {time.monotonic() - started:.0f} s)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
