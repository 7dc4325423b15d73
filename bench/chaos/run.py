"""One chaos run, start to end: the fleet up, clients, rotator, probes and nemesis on, the last heal, the checks.

`run(config, deps, workdir)` returns the report (`bench.chaos.report`); the services (OpenBao, PostgreSQL,
Redis) are the caller's (`bench.chaos.cli` starts its own, the e2e test passes its fixtures').

The end of a run, in order: the rotator stops (a step waiting on its gates writes nothing), the nemesis stops
and heals everything (resumes, restarts, restores every link, frees the disk); then every instance must
serve the ring's generation within 3 s (plus the host's lateness) and ``fleet status`` must agree; the
clients go on for `Config.after_heal` s, then stop; each instance's last probe gives its audit sink's ``dropped``;
every instance is stopped cleanly (its sink flushes); the audit log is read and verified.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fixtures.common import run_cli
from tests.support.lateness import Relay

from bench.chaos import audit_check, fleet, report, resources
from bench.chaos.checker import SKEW, Checker
from bench.chaos.fleet import AUDIENCE, Deps, Links, Member
from bench.chaos.nemesis import Nemesis, Timeline
from bench.chaos.probes import Prober
from bench.chaos.ring_faults import RingFaults
from bench.chaos.rotator import Rotator
from bench.chaos.schedule import KINDS, Schedule, make_schedule
from bench.chaos.traffic import Traffic
from bench.chaos.typescript import TsClients

CONVERGE = 3.0
"""Seconds within which every instance serves the newest generation after the last heal."""
READY_GRACE = 5.0
QUIET = 10.0
"""Seconds from the last client's end to the resources' end level: every kept-alive connection has closed
(the sidecar's keep_alive_timeout is 8 s, uvicorn's 5 s)."""


@dataclass
class Config:
    seconds: float
    seed: int
    instances: int = 5
    ttl: float = 30.0
    rate: float = 5.0
    force_after_ttl: bool = False
    warmup: float = 300.0
    window: float = 300.0
    resource_every: float = 10.0
    longest: float = 30.0
    menu: tuple[str, ...] = KINDS
    spare: tuple[str, ...] = ("mcp-1", "sc-1")
    """Instances never killed: their processes live the whole run, so their resources can be judged."""
    replay: Schedule | None = None
    results_dir: Path | None = None
    quiet: bool = False
    anchor_every: float = 10.0
    """Seconds between two anchors of an instance's audit heads (the product's default is 300)."""
    after_heal: float = 5.0
    """Seconds the clients go on after the last heal (every round then must be served)."""
    typescript: bool = True
    """Also run the TypeScript servers and client (`bench.chaos.typescript`) when ``node`` is on PATH."""

    def names(self) -> list[str]:
        n_sidecars = max(1, self.instances * 2 // 5)
        n_mcp = self.instances - n_sidecars
        return [f"mcp-{i}" for i in range(1, n_mcp + 1)] + [f"sc-{i}" for i in range(1, n_sidecars + 1)]


@dataclass
class Run:
    config: Config
    deps: Deps
    workdir: Path
    ring: str = ""
    state: Path = Path()
    anchors: Path = Path()
    """The directory every instance anchors its audit heads to (issue 38)."""
    members: dict[str, Member] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds each part of the run took: setup, faults, ending, checks."""
    closers: list[Any] = field(default_factory=list)
    """Every started component's stop (idempotent), run in reverse at the end even after an error."""

    def log(self, line: str) -> None:
        if not self.config.quiet:
            print(line, flush=True)

    def env(self) -> dict[str, str]:
        """The environment of a CLI run straight at the services (no fault proxy)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MRTR_KEYS_", "VAULT_", "BAO_"))}
        env.update(
            VAULT_ADDR=self.deps.vault_addr,
            BAO_ADDR=self.deps.vault_addr,
            VAULT_TOKEN=self.deps.vault_token,
            BAO_TOKEN=self.deps.vault_token,
            MRTR_KEYS_KEYSTORE=self.ring,
            MRTR_KEYS_AUDIT=self.deps.pg_url,
            MRTR_KEYS_STATE_DIR=str(self.state),
        )
        return env


def _schedule(config: Config, names: list[str]) -> Schedule:
    if config.replay is not None:
        return config.replay
    spare = [n for n in names if n not in config.spare] or names
    return make_schedule(
        config.seed,
        config.seconds,
        names,
        rate=config.rate,
        menu=config.menu,
        start=min(10.0, config.seconds / 6),
        tail=min(10.0, config.seconds / 8),
        longest=config.longest,
        killable=spare,
    )


def run(config: Config, deps: Deps, workdir: Path) -> dict[str, Any]:
    """The whole run (see the module docstring); the report."""
    r = Run(config, deps, workdir)
    r.state = workdir / "state"
    r.anchors = workdir / "anchors"
    r.anchors.mkdir(parents=True, exist_ok=True)
    disk = fleet.mount_state_dir(r.state)
    r.ring = f"vault-kv://secret/chaos/{workdir.name}"
    links = Links(deps)
    relay = Relay(history=200_000)
    offset = time.time() - time.monotonic()
    names = config.names()
    schedule = _schedule(config, names)
    began = time.time()
    try:
        init = run_cli("init", "--ttl", f"{config.ttl:g}", "--audience", AUDIENCE, env=r.env())
        assert init.code == 0, init.err
        added = run_cli("clients", "add", "driver", "--audience", AUDIENCE, "--json", env=r.env())
        assert added.code == 0, added.err
        secret = str(added.json()["secret"])
        logs = workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name in names:
            kind = "mcp" if name.startswith("mcp-") else "sidecar"
            anchors = (r.anchors, config.anchor_every)
            made = fleet.member(
                kind, name, r.ring, deps, links.make(name), r.state, logs, ttl=config.ttl, anchors=anchors
            )
            r.members[name] = made
        threads = [threading.Thread(target=fleet.start, args=(m,)) for m in r.members.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if any(not m.ready() for m in r.members.values()):
            raise RuntimeError(
                "the fleet did not start: " + ", ".join(m.name for m in r.members.values() if not m.ready())
            )
        r.timings["setup"] = round(time.time() - began, 1)
        return _run(r, schedule, links, relay, offset, secret, disk)
    finally:
        for close in reversed(r.closers):
            try:
                close()
            except Exception as exc:
                r.log(f"[chaos] while stopping: {type(exc).__name__}: {exc}")
        relay.stop()
        for member in r.members.values():
            try:
                fleet.stop(member)
            except Exception:
                fleet.kill(member)
        links.close()
        fleet.free_disk(r.state)
        fleet.mend_anchors(r.anchors)
        if disk:
            fleet.unmount_state_dir(r.state)


def _run(
    r: Run, schedule: Schedule, links: Links, relay: Relay, offset: float, secret: str, disk: bool
) -> dict[str, Any]:
    config = r.config

    def lateness(start: float, end: float) -> float:
        return relay.overrun_between(start - offset, end - offset)

    ring_generation = _ring_reader(r)
    presence = _presence_reader(r.deps.pg_url)
    timeline = Timeline()
    checker = Checker(r.members, timeline, config.ttl, lateness)
    ring = RingFaults(r.env, checker.report)
    checker.revoked = ring.revoked
    nemesis = Nemesis(schedule, r.members, links, r.state, ring=ring.run, disk_full=disk, anchors=r.anchors, log=r.log)
    nemesis.timeline = timeline
    r.log(f"[chaos] schedule: seed {schedule.seed}, {len(schedule.faults)} faults")
    for fault in schedule.faults:
        r.log("[chaos]   " + fault.label())
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    results = config.results_dir
    schedule_path = None
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        schedule_path = schedule.save(results / f"chaos-{stamp}-schedule.json")
    prober = Prober(r.members, secret, ring_generation=ring_generation, presence=presence).start()
    sampler = resources.Sampler(r.members, every=config.resource_every).start()
    r.closers += [prober.stop, sampler.stop, nemesis.stop]
    traffic = Traffic(
        r.members,
        secret,
        seed=config.seed,
        on_accepted=lambda x: r.log(f"[chaos] ACCEPTED at {x.t_open or x.t0:.3f}: a {x.kind} token by {x.opener}"),
    ).start()
    r.closers.append(traffic.stop)
    rotator_env = {**fleet.link_env(r.deps, links.make("rotator"), r.state), "MRTR_KEYS_KEYSTORE": r.ring}
    ts = None
    if config.typescript and shutil.which("node"):
        sidecars = [m for m in r.members.values() if m.kind == "sidecar"]
        ts = TsClients(sidecars, secret, config.ttl, r.workdir / "logs" / "ts")
        r.closers.append(ts.stop)
        ts.start()
    rotator = Rotator(r.ring, rotator_env, r.workdir / "logs", force_after_ttl=config.force_after_ttl).start()
    r.closers.append(rotator.stop)
    t0 = time.time()
    nemesis.start(t0)
    next_line = t0
    while time.time() < t0 + config.seconds:
        time.sleep(min(1.0, max(0.0, t0 + config.seconds - time.time())))
        if time.time() >= next_line:
            next_line += 60 if config.seconds >= 600 else 10
            r.log(
                f"[chaos] {time.time() - t0:6.0f} s: {len(nemesis.timeline.applied)} faults, "
                f"{traffic.summary()}, rotations {rotator.retires}, violations {len(checker.violations)}"
            )
    r.timings["faults"] = round(time.time() - t0, 1)
    rotator.stop()
    healed = nemesis.heal_all()
    names = sorted(r.members)
    took = prober.wait_converged(names, timeout=30.0)
    bound = CONVERGE + lateness(healed, healed + CONVERGE)
    if took is None or took > bound:
        checker.report(
            healed,
            f"after the last heal the fleet did not serve the newest generation within {bound:.1f} s",
            f"took {took}",
        )
    status = run_cli("fleet", "status", "--json", env=r.env())
    _fleet_status_agrees(status, names, ring_generation(), checker)
    time.sleep(config.after_heal)
    traffic.stop()
    if ts is not None:
        ts.stop()
        traffic.rounds.extend(ts.rounds())
    time.sleep(1.0)
    prober.stop()
    sampler.stop()
    if config.seconds >= config.warmup + config.window:  # resources are judged: the end level, quiet
        time.sleep(QUIET)
        for _ in range(3):
            sampler.sample()
            time.sleep(1.0)
    for member in r.members.values():
        fleet.stop(member)
    r.timings["ending"] = round(time.time() - t0 - r.timings["faults"], 1)
    fp = audit_check.fingerprinter(r.state)
    index = audit_check.load_index(r.deps.pg_url)
    checker.classify_rounds(traffic.rounds, index, fp)
    expected = audit_check.expected_events(traffic.rounds, r.members, fp)
    dropped = audit_check.last_dropped(prober.samples.members)
    spent_again = {fp(x.token) for x in checker.spent_again if x.token}
    audit_counts = audit_check.check_events(
        index, expected, dropped, nemesis.timeline, checker.report, spent_again, record_life=checker.ttl + SKEW
    )
    code, out = audit_check.verify(r.env(), run_cli, r.anchors)
    if code != 0:
        checker.report(time.time(), f"audit verify exited {code}", out)
    readiness = checker.check_readiness(prober.samples, READY_GRACE)
    readiness.update(checker.check_fencing(prober.samples, index, fleet.HEARTBEAT))
    convergence = checker.convergence(prober.samples)
    resource_rows, breaches = resources.judge(sampler.series, warmup=config.warmup, window=config.window)
    for b in breaches:
        checker.report(time.time(), "resource growth after the warm-up", b)
    checker.check_rotation(rotator.failures)
    r.timings["checks"] = round(time.time() - t0 - r.timings["faults"] - r.timings["ending"], 1)
    doc = report.build(
        config=config,
        schedule=schedule,
        schedule_path=schedule_path,
        nemesis=nemesis,
        traffic=traffic,
        rotator=rotator,
        checker=checker,
        convergence=convergence,
        last_heal=took,
        readiness=dict(readiness),
        audit={**audit_counts, "events": index.total, "verify_exit": code, "reasons": dict(index.reasons)},
        resources=resource_rows,
        lateness=relay.overrun,
        probe_errors=prober.errors[:20],
    )
    doc["timings"] = r.timings
    doc["anchors"] = sum(1 for f in r.anchors.rglob("*") if f.is_file())
    if results is not None:
        doc["results"] = str(
            report.write(
                doc, results, stamp, rounds=traffic.rounds, probes=prober.samples.members, logs=r.workdir / "logs"
            )
        )
    return doc


def _ring_reader(r: Run) -> Any:
    """Reads the ring's generation straight from OpenBao (no fault proxy)."""
    from mrtr_keys.keystores.vault_kv import VaultKVKeystore
    from mrtr_keys.providers.vault.client import VaultClient
    from mrtr_keys.providers.vault.settings import VaultSettings

    mount, _, path = r.ring.split("://", 1)[1].partition("/")
    client = VaultClient(VaultSettings(addr=r.deps.vault_addr, token=r.deps.vault_token, timeout=5.0))
    keystore = VaultKVKeystore(mount, path, client=client, state_dir=r.state)

    def read() -> int:
        return int(keystore.load().generation)

    return read


def _presence_reader(pg_url: str) -> Any:
    from mrtr_keys.audit.writing.stores.url import open_store
    from mrtr_keys.fleet.presence import read_instances

    store = open_store(pg_url)

    def read() -> dict[str, tuple[int | None, str | None, str]]:
        return {rec.name: (rec.generation, rec.note, rec.state) for rec in read_instances(store)}

    return read


def _fleet_status_agrees(status: Any, names: list[str], generation: int, checker: Checker) -> None:
    if status.code != 0:
        checker.report(time.time(), f"fleet status exited {status.code}", status.err)
        return
    rows = {row["name"]: row for row in status.json()}
    for name in names:
        row = rows.get(name)
        if row is None or row.get("status") != "live" or row.get("generation") != generation:
            checker.report(time.time(), f"fleet status disagrees about {name} after the last heal", repr(row))
