"""Resources of every fleet process over the run: RSS, threads and open files, from /proc.

`Sampler` reads, every `every` seconds, each member's process and its children (the audit writer) by pid.
`judge` looks at each process that lived past `warmup` and then for at least `window` more seconds: its RSS
slope after the warm-up (least squares, MB a minute) must stay under `RSS_SLOPE`, and its threads and open
files at the end (the median of its last three samples, taken once every fault is healed, the clients have
stopped and their kept-alive connections have closed) within 10 % of
their level at the end of the warm-up (median of the samples in the minute after it), or 2 more, whichever
is larger (a level of 9 threads allows 11: 10 % of a small count is less than one thread).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.chaos.fleet import Member, children

RSS_SLOPE = 1.0
"""MB a minute."""
LEVEL_GROWTH = 0.10
LEVEL_SLACK = 2


@dataclass
class Series:
    name: str
    """``mcp-1`` or ``mcp-1 writer``."""
    pid: int
    points: list[tuple[float, float, int, int]] = field(default_factory=list)
    """(time, RSS MB, threads, open files)."""
    files: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    """(time, `fd_kinds`) at every sample: what the open files were."""


def fd_kinds(pid: int) -> dict[str, int]:
    """What `pid`'s open files are, counted: ``pipe``, ``socket -> :PORT`` (a TCP socket by its remote port, or
    ``socket listening :PORT``), ``socket`` (another kind), a path, ``anon_inode:...``."""
    peers: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, remote, inode = cols[1], cols[2], cols[9]
            port = int(remote.rsplit(":", 1)[1], 16)
            peers[inode] = f"socket -> :{port}" if port else f"socket listening :{int(local.rsplit(':', 1)[1], 16)}"
    out: dict[str, int] = {}
    try:
        names = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return out
    for fd in names:
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        if target.startswith("socket:["):
            label = peers.get(target[8:-1], "socket")
        elif target.startswith("pipe:"):
            label = "pipe"
        else:
            label = target
        out[label] = out.get(label, 0) + 1
    return dict(sorted(out.items()))


def read_proc(pid: int) -> tuple[float, int, int] | None:
    """(RSS in MB, threads, open files) of `pid`, or None if it is gone."""
    try:
        rss = threads = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
        fds = sum(1 for _ in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    return rss / 1024.0, threads, fds


class Sampler:
    def __init__(self, members: dict[str, Member], every: float = 10.0) -> None:
        self.members = members
        self.every = every
        self.series: dict[int, Series] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._loop, name="chaos-resources", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def sample(self) -> None:
        now = time.time()
        for member in list(self.members.values()):
            pid = member.pid
            if pid is None or member.killed:
                continue
            for p, label in [(pid, member.name), *((c, f"{member.name} writer") for c in children(pid))]:
                got = read_proc(p)
                if got is not None:
                    series = self.series.setdefault(p, Series(label, p))
                    series.points.append((now, *got))
                    series.files.append((now, fd_kinds(p)))

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (time s, value) in value a minute (0 for fewer than 3 points)."""
    if len(points) < 3:
        return 0.0
    xs = [t for t, _ in points]
    ys = [v for _, v in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def judge(series: dict[int, Series], *, warmup: float, window: float) -> tuple[list[dict[str, object]], list[str]]:
    """Per judged process: its figures; and a message for each breach (see the module docstring)."""
    rows: list[dict[str, object]] = []
    breaches: list[str] = []
    for s in series.values():
        if not s.points:
            continue
        start = s.points[0][0]
        after = [p for p in s.points if p[0] >= start + warmup]
        if not after or after[-1][0] - after[0][0] < window:
            continue
        rss_slope = slope([(t, rss) for t, rss, _, _ in after])
        first = [p for p in after if p[0] <= after[0][0] + 60] or after[:1]
        last = after[-3:]
        row: dict[str, object] = {"process": s.name, "pid": s.pid, "minutes": round((after[-1][0] - start) / 60, 1)}
        row["rss_mb_per_min"] = round(rss_slope, 3)
        row["rss_mb"] = [
            round(statistics.median(p[1] for p in first), 1),
            round(statistics.median(p[1] for p in last), 1),
        ]
        for i, what in ((2, "threads"), (3, "open_files")):
            level = statistics.median(p[i] for p in first)
            end = statistics.median(p[i] for p in last)
            row[what] = [level, end]
            allowed = max(math.ceil(level * (1 + LEVEL_GROWTH)), level + LEVEL_SLACK)
            if end > allowed:
                files = ""
                if what == "open_files":
                    then = next((kinds for t, kinds in s.files if t >= first[0][0]), {})
                    files = f" (then {then}, at the end {s.files[-1][1] if s.files else {}})"
                breaches.append(
                    f"{s.name} (pid {s.pid}): {what} {level:g} after the warm-up, {end:g} at the end{files}"
                )
        if rss_slope >= RSS_SLOPE:
            breaches.append(f"{s.name} (pid {s.pid}): RSS grows {rss_slope:.2f} MB a minute after the warm-up")
        rows.append(row)
    return rows, breaches
