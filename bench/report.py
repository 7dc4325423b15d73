"""The one table every part fills: rows with median, spread, ratio to an anchor, target and verdict.

A row's `ratio` is always measured against an anchor in the same process and the same
run (never against a number from another day). `status` is ``PASS``/``MISS`` when the
row has a target, ``info`` when it is context for another row, and ``n/a`` when the
thing measured is not there (a module not built yet, a tool missing); `note` says why.
The table prints as Markdown (so docs/performance.md can quote it verbatim) and is saved
as JSON under bench/results/.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    """One measured line of the table.

    `median` and `spread` are in `unit`; `spread` is the interquartile range over the
    repeats (half of it either side of the median, roughly), or the min-max range for
    fewer than 4 repeats. `ratio` is the median of per-repeat subject/anchor ratios.
    """

    part: str
    name: str
    unit: str = ""
    median: float | None = None
    spread: float | None = None
    anchor: str = ""
    ratio: float | None = None
    target: str = ""
    status: str = "info"
    note: str = ""
    samples: list[float] = field(default_factory=list)

    def decide(self, value: float | None, target: str) -> Row:
        """Set `target` and the verdict from `value` (a ratio for ``x`` targets, else in the target's unit)."""
        self.target = target
        self.status = judge(value, target)
        return self

    @classmethod
    def missing(cls, part: str, name: str, why: str, *, target: str = "") -> Row:
        """A row for something that cannot be measured in this tree yet (status ``n/a``)."""
        return cls(part=part, name=name, target=target, status="n/a", note=why)


def spread_of(samples: Sequence[float]) -> float:
    """Interquartile range (>= 4 samples) or max - min (fewer); 0 for one sample."""
    if len(samples) < 2:
        return 0.0
    if len(samples) < 4:
        return max(samples) - min(samples)
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return q[2] - q[0]


def judge(value: float | None, target: str) -> str:
    """``PASS``/``MISS`` for `value` against a target written ``<= 0.7x``, ``>= 2x``, ``< 0.3 s``, ``< 20 MB``,
    ``== 0 calls``; ``info`` without a target, ``n/a`` without a value."""
    if not target:
        return "info"
    if value is None:
        return "n/a"
    op, _, rest = target.partition(" ")
    limit = float(rest.split()[0].rstrip("x"))
    checks: dict[str, Callable[[float, float], bool]] = {
        "<=": lambda a, b: a <= b,
        "<": lambda a, b: a < b,
        ">=": lambda a, b: a >= b,
        ">": lambda a, b: a > b,
        "==": lambda a, b: a == b,
    }
    return "PASS" if checks[op](value, limit) else "MISS"


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if value == 0:
        text = "0"
    elif abs(value) >= 1000:
        text = f"{value:,.0f}"
    elif abs(value) >= 100:
        text = f"{value:.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    elif abs(value) >= 1:
        text = f"{value:.2f}"
    else:
        text = f"{value:.3f}"
    return f"{text} {unit}".strip()


def render(rows: Sequence[Row]) -> str:
    """The rows as one Markdown table (the form printed and pasted into docs/performance.md)."""
    head = ["part", "row", "median", "spread (IQR)", "anchor", "ratio", "target", "result", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        cells = [
            r.part,
            r.name,
            _fmt(r.median, r.unit),
            _fmt(r.spread, r.unit) if r.spread is not None else "-",
            r.anchor or "-",
            ratio,
            r.target or "-",
            r.status,
            r.note.replace("|", "/"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    """What the numbers were measured on: core count, CPU model, Python, OS, load."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }
    try:
        info["loadavg_at_start"] = list(os.getloadavg())
    except OSError:
        pass
    try:
        import cryptography

        info["cryptography"] = cryptography.__version__
    except ImportError:
        pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
        if rev.returncode == 0:
            info["git"] = rev.stdout.strip()
    except OSError:
        pass
    return info


def write_results(rows: Sequence[Row], *, meta: dict[str, Any], directory: Path = RESULTS_DIR) -> Path:
    """Save the run as bench/results/<UTC timestamp>.json and bench/results/latest.json; returns the first."""
    directory.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    doc = {"time": datetime.now(UTC).isoformat(timespec="seconds"), **meta, "rows": [asdict(r) for r in rows]}
    text = json.dumps(doc, indent=2) + "\n"
    path = directory / f"{stamp}.json"
    path.write_text(text)
    (directory / "latest.json").write_text(text)
    return path


DOCS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
_BEGIN = "<!-- bench:latest:begin -->"
_END = "<!-- bench:latest:end -->"


def update_docs(table: str, meta: dict[str, Any], page: Path = DOCS_PAGE) -> bool:
    """Replace the block between the ``bench:latest`` markers of docs/performance.md with this run.

    Returns False (and changes nothing) if the page or its markers are missing.
    """
    if not page.exists():
        return False
    text = page.read_text()
    if _BEGIN not in text or _END not in text:
        return False
    m = meta.get("machine", {})
    load = m.get("loadavg_at_start")
    block = "\n".join(
        [
            _BEGIN,
            f"Run of {meta.get('time', '?')} (git {m.get('git', '?')}), parts: {', '.join(meta.get('parts', []))}; "
            f"{meta.get('seconds', '?')} s.",
            f"Machine: {m.get('nproc')} CPUs ({m.get('cpu')}), Python {m.get('python')}, "
            f"cryptography {m.get('cryptography', '?')}, {m.get('platform')}"
            + (f"; load average at start {load[0]:.1f}" if load else "")
            + ".",
            "",
            table,
            _END,
        ]
    )
    head, _, rest = text.partition(_BEGIN)
    _, _, tail = rest.partition(_END)
    page.write_text(head + block + tail)
    return True
