"""``python -m bench [part ...]``: run the benchmark parts and print one table with PASS/MISS.

Parts (default: all, in this order): inprocess, vault_remote, sidecar_load, stalled, audit, audit_scale,
single_use, faults, cli_time, memory, fleet, typescript (one line and an n/a row without node); fleet_paused, the
paused-instance rows of fleet, and fleet_revoke, its revocation rows, can also run alone. Services
(OpenBao dev server, moto server, the sidecar) are started on free loopback ports and stopped at the end.
Results are printed as a Markdown table and written to bench/results/<timestamp>.json and
bench/results/latest.json.

``python -m bench chaos --minutes M --seed S [--json] [--replay FILE]`` is the chaos soak (`bench.chaos`,
docs/reliability.md): its own command line, run alone.

Options: ``--quick`` (tiny counts, for a smoke run), ``--ops N`` (operations for the
memory part, default 1,000,000), ``--repeats N``, ``--seconds S`` (per wrk run),
``--no-write`` (print only), ``--results-dir DIR``, ``--docs`` (also refresh the table in
docs/performance.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from bench.common import Settings
from bench.report import RESULTS_DIR, Row, machine, render, update_docs, write_results
from bench.services import Services

PARTS = (
    "inprocess",
    "vault_remote",
    "sidecar_load",
    "stalled",
    "audit",
    "audit_scale",
    "single_use",
    "faults",
    "cli_time",
    "memory",
    "fleet",
    "typescript",
)
ALONE = ("fleet_paused", "fleet_revoke")
"""Parts that run by name only (each is also inside a part of `PARTS`)."""


def run_parts(parts: list[str], settings: Settings) -> list[Row]:
    """Run `parts` in order with shared services; a part that crashes becomes one ``n/a`` row."""
    rows: list[Row] = []
    with Services() as services:
        for part in parts:
            started = time.monotonic()
            print(f"[bench] {part} ...", file=sys.stderr, flush=True)
            try:
                module = importlib.import_module(f"bench.{part}")
                rows.extend(module.run(services, settings))
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                rows.append(Row.missing(part, "(part failed)", f"n/a (error: {type(exc).__name__}: {exc})"[:200]))
            print(f"[bench] {part} done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["chaos"]:
        from bench.chaos.cli import main as chaos

        return chaos(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", choices=[*PARTS, *ALONE, []], help="parts to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="tiny counts (smoke run; numbers are noise)")
    parser.add_argument("--ops", type=int, help="operations for the memory part (default 1,000,000)")
    parser.add_argument("--repeats", type=int, help="interleaved rounds per in-process measurement")
    parser.add_argument("--seconds", type=float, help="duration of each wrk run")
    parser.add_argument("--no-write", action="store_true", help="do not write bench/results/")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where to write the JSON results")
    parser.add_argument("--docs", action="store_true", help="also put this table into docs/performance.md")
    args = parser.parse_args(argv)
    settings = Settings.tiny() if args.quick else Settings()
    changes: dict[str, object] = {}
    if args.ops is not None:
        changes["memory_ops"] = args.ops
    if args.repeats is not None:
        changes["repeats"] = args.repeats
    if args.seconds is not None:
        changes["wrk_seconds"] = args.seconds
    settings = dataclasses.replace(settings, **changes)  # type: ignore[arg-type]
    parts = list(args.parts) or list(PARTS)
    info = machine()
    started = time.monotonic()
    rows = run_parts(parts, settings)
    table = render(rows)
    print(table)
    misses = sum(r.status == "MISS" for r in rows)
    passes = sum(r.status == "PASS" for r in rows)
    print(f"\n{passes} PASS, {misses} MISS, {sum(r.status == 'n/a' for r in rows)} n/a")
    if not args.no_write:
        meta = {
            "machine": info,
            "parts": parts,
            "settings": dataclasses.asdict(settings),
            "seconds": round(time.monotonic() - started, 1),
            "table": table,
        }
        path = write_results(rows, meta=meta, directory=args.results_dir)
        print(f"results: {path}", file=sys.stderr)
        if args.docs:
            meta["time"] = json.loads(path.read_text())["time"]
            updated = update_docs(table, meta)
            print("docs/performance.md " + ("updated" if updated else "not updated (no markers)"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
