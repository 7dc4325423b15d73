"""The chaos run's report: one JSON document (``bench/results/chaos-<UTC>.json``) and a short text summary.

Keys: ``seed``, ``minutes``, ``faults`` (kind -> faults applied), ``rounds`` (crossing flows the clients
ran), ``rejections`` (reason -> rounds rejected, each by design or marked ``NOT BY DESIGN``),
``violations`` (each with ``at``, ``what``, ``faults``, ``evidence``), and ``failures`` (failed rounds by
cause), ``forger`` (forged and replayed calls by outcome), ``rotations`` (completed), ``rotation_steps``,
``convergence`` (seconds from each heal to the whole fleet on the ring's generation: ``p50``, ``p99``,
``max``, and ``last_heal``), ``readiness`` (the readiness rules checked, by rule), ``audit`` (events
expected, found, lost with a kill, counted dropped; ``verify_exit``), ``resources`` (per judged process:
RSS slope, threads and open files after the warm-up and at the end), ``lateness`` (the host's largest
overrun, seconds) and ``schedule`` (the saved schedule, for ``--replay``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def build(
    *,
    config: Any,
    schedule: Any,
    schedule_path: Path | None,
    nemesis: Any,
    traffic: Any,
    rotator: Any,
    checker: Any,
    convergence: list[float],
    last_heal: float | None,
    readiness: dict[str, int],
    audit: dict[str, Any],
    resources: list[dict[str, object]],
    lateness: float,
    probe_errors: list[str],
) -> dict[str, Any]:
    applied = [a for a in nemesis.timeline.applied if not a.note.startswith("not ")]
    faults = collections.Counter(a.fault.kind for a in applied)
    legit = [r for r in traffic.rounds if not r.forged]
    steps = collections.Counter(f"{s.step or '?'} exit {s.code}" for s in rotator.steps)
    return {
        "seed": schedule.seed,
        "minutes": round(config.seconds / 60, 2),
        "instances": sorted(nemesis.members),
        "faults": dict(sorted(faults.items())),
        "faults_total": sum(faults.values()),
        "faults_not_applied": [a.to_dict() for a in nemesis.timeline.applied if a.note.startswith("not ")],
        "rounds": len(legit),
        "rounds_by_outcome": dict(sorted(collections.Counter(f"{r.kind} {r.outcome}" for r in legit).items())),
        "rejections": dict(sorted(checker.rejections.items())),
        "failures": dict(sorted(checker.failures.items())),
        "forger": dict(sorted(checker.forger.items())),
        "violations": [v.to_dict() for v in checker.violations],
        "rotations": rotator.retires,
        "rotation_steps": dict(sorted(steps.items())),
        "convergence": {
            "heals": len(convergence),
            "p50": percentile(convergence, 0.5),
            "p99": percentile(convergence, 0.99),
            "max": max(convergence, default=None),
            "last_heal": last_heal,
        },
        "readiness": readiness,
        "audit": audit,
        "resources": resources,
        "lateness": round(lateness, 3),
        "nemesis_errors": nemesis.errors[:20],
        "probe_errors": probe_errors,
        "schedule": str(schedule_path) if schedule_path else None,
        "applied": [a.to_dict() for a in nemesis.timeline.applied],
    }


def write(
    doc: dict[str, Any], directory: Path, stamp: str, *, rounds: list[Any], probes: list[Any], logs: Path | None
) -> Path:
    """The report as ``chaos-STAMP.json`` in `directory`; beside it every round as ``chaos-STAMP-rounds.jsonl``,
    every probe as ``chaos-STAMP-probes.jsonl`` and the processes' logs under ``chaos-STAMP-logs/`` (the
    evidence behind each violation)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"chaos-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    with (directory / f"chaos-{stamp}-rounds.jsonl").open("w") as out:
        for r in rounds:
            out.write(json.dumps(dataclasses.asdict(r), default=str) + "\n")
    with (directory / f"chaos-{stamp}-probes.jsonl").open("w") as out:
        for sample in probes:
            out.write(json.dumps(dataclasses.asdict(sample), default=str) + "\n")
    if logs is not None and logs.is_dir():
        shutil.copytree(logs, directory / f"chaos-{stamp}-logs", dirs_exist_ok=True)
    return path


def summary(doc: dict[str, Any]) -> str:
    """A few lines for a person (the JSON has everything)."""
    conv = doc["convergence"]
    lines = [
        f"chaos: seed {doc['seed']}, {doc['minutes']} min, instances {', '.join(doc['instances'])}",
        f"faults ({doc['faults_total']}): " + ", ".join(f"{k} {v}" for k, v in doc["faults"].items()),
        f"rounds: {doc['rounds']} ({', '.join(f'{k} {v}' for k, v in doc['rounds_by_outcome'].items())})",
        "rejections: " + (", ".join(f"{k}: {v}" for k, v in doc["rejections"].items()) or "none"),
        "failures: " + (", ".join(f"{k}: {v}" for k, v in doc["failures"].items()) or "none"),
        "forger: " + (", ".join(f"{k} {v}" for k, v in doc["forger"].items()) or "none"),
        f"rotations: {doc['rotations']} ({', '.join(f'{k} {v}' for k, v in doc['rotation_steps'].items())})",
        f"convergence after {conv['heals']} heals: p50 {conv['p50']}, p99 {conv['p99']}, max {conv['max']}; "
        f"after the last heal {conv['last_heal']}",
        f"audit: {doc['audit'].get('expected')} events expected, {doc['audit'].get('found')} found, "
        f"{doc['audit'].get('lost_with_a_kill', 0)} lost with a kill, {doc['audit'].get('counted_dropped', 0)} "
        f"counted dropped; verify exit {doc['audit'].get('verify_exit')}",
        f"resources judged: {len(doc['resources'])} processes; host lateness up to {doc['lateness']} s",
        f"violations: {len(doc['violations'])}",
    ]
    lines += [f"  at {v['at']}: {v['what']} | faults {v['faults']} | {v['evidence'][:300]}" for v in doc["violations"]]
    return "\n".join(lines)
