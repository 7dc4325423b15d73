"""Part audit_scale: the audit log at 1 M and 5 M events (issue 26): verify, prune, bytes per event.

For each size, a fresh SQLite store is filled with genuine events (`bench.audit_log.fill`: the
writer's own rows and chain, times spread over 40 days), then measured with the real CLI in a child
process (wall time; peak RSS from ``wait4``):

* ``audit verify --json``: events/s, against the anchor of the same run: a bare read of every row
  (``SELECT`` in pages, no hashing; target: verify at least 1.3x it, issue 38: the walk is spread over
  two reading processes), and its peak RSS (target < 200 MB); the RSS ratio large/small shows the growth
  (target flat: <= 1.2x). The logs' links are keyed (chain version 2), as every writer's now;
* ``audit prune --before 35d`` (an eighth of the events): events deleted/s;
* ``audit archive --before 30d`` (the next eighth) to a directory: the export rate (segments and
  manifest written, from the command's ``write_records_per_second``; target >= 200,000 events/s) and
  the whole command's rate (verifying walk + export + prune); then ``verify`` and ``verify
  --from-archive`` (archive and live store as one history) events/s;
* bytes per event (the store file, indexes included; target <= 180 B);
* ``mrtr-keys rotate retire`` refused by its gate (a ring beside the log, begun and promoted: CLI
  start-up, presence rows and the sealing query);
* lookups that must stay flat as the log grows (schema 4 indexes): the retire gate's query (the newest
  ``ok`` seal of a kid within the TTL; `mrtr_keys.fleet.gates.sealing_wait`), ``audit query --kid K
  --limit 20`` and ``--kid`` of a rare kid (CLI child, start-up included), and ``--token`` (the
  fingerprint lookup, in process: the bench's audit key is not beside a ring), and ``audit stats``
  over the whole log and over a window starting inside an hour (in process: the hourly totals and
  the edge hour's scan, `mrtr_keys.audit.writing.stores.hours`). Target: within 2x for 5x the events.

Then `bench.audit_retention`: a running sidecar's own retention (``serve --audit-retention``)
prunes a quarter of a 200,000-event log while a client measures seal+unseal p99 (target <= 2x the
same sidecar's p99 without retention).

Sizes: ``MRTR_KEYS_BENCH_AUDIT_SIZES`` (default ``1000000,5000000``; ``--quick``: 10 000 and 40 000).

PostgreSQL (issue 38): a log of ``MRTR_KEYS_BENCH_AUDIT_PG_SIZES`` events (default ``1000000``; ``--quick``:
20 000; empty: none) in a throwaway database, over 2 days (a partition a day): ``audit verify`` events/s
against its own bare paged read (target >= 1.0x) and its peak RSS.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import audit_retention
from bench.audit_log import fill
from bench.common import Settings
from bench.report import Row
from bench.services import Services

PART = "audit_scale"
REPO = Path(__file__).resolve().parents[1]
KEY_ENV: dict[str, str] = {}
"""``MRTR_KEYS_AUDIT_KEY_FILE`` of the run: the fleet audit key the logs are filled and verified with."""


_PEAK = """
import atexit, os, re, resource, sys
def _peak():
    own = int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    os.write(int(os.environ["BENCH_PEAK_FD"]), str(max(own, children)).encode())
atexit.register(_peak)
from mrtr_keys.cli.main import run
sys.argv = ['mrtr-keys', *sys.argv[1:]]
run()
"""
"""The CLI, reporting at exit the largest resident set of its own process (VmHWM, which exec resets) and of
the children it waited for (verify's readers, forked from it) in KiB. Not `wait4`'s ``ru_maxrss`` of the
CLI: Linux keeps that high-water mark across fork and exec, so it read at least the bench process's own size
(241 MB in the 2026-12-07 table, at every size and for every command)."""


def _cli(*args: str, codes: tuple[int, ...] = (0, 1)) -> tuple[dict[str, object], float, int]:
    """(JSON output, wall seconds, peak RSS MiB: the largest of the CLI's process and its readers) of
    ``mrtr-keys ARGS`` in a child process (exit code in `codes`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRTR_KEYS_")} | KEY_ENV
    read, write = os.pipe()
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            started = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-c", _PEAK, *args],
                stdout=out,
                stderr=err,
                env={**env, "BENCH_PEAK_FD": str(write)},
                cwd=REPO,
                pass_fds=(write,),
            )
            os.close(write)
            write = -1
            returncode = proc.wait()
            elapsed = time.perf_counter() - started
            peak_kib = int(os.read(read, 64) or b"0")
            out.seek(0)
            err.seek(0)
            text = out.read().decode()
            if returncode not in codes:
                raise RuntimeError(f"mrtr-keys {' '.join(args)}: {err.read().decode().strip()}")
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    return json.loads(text), elapsed, peak_kib // 1024


def _bare_read(url: str) -> float:
    """Rows per second of reading every row in pages, nothing else (the anchor)."""
    from mrtr_keys.audit.writing.stores.url import open_store

    store = open_store(url)
    started = time.perf_counter()
    n = sum(len(rows) for rows in store.row_batches(0))
    elapsed = time.perf_counter() - started
    store.close()
    return n / elapsed


def _timed(fn: object) -> float:
    started = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - started


def _lookups(url: str) -> dict[str, float]:
    """Seconds of each lookup (best of 3, warm) on the store at `url`."""
    from mrtr_keys.audit.events import format_ts
    from mrtr_keys.audit.writing.stores.base import Query
    from mrtr_keys.audit.writing.stores.url import open_store

    store = open_store(url)
    try:
        fp = "f" * 24  # a token the log has not seen: the lookup itself (the fill reuses 32 tokens)
        gate = Query(
            op="seal", kid="1a2b3c4d", outcome="ok", since=format_ts(time.time() - 3_660), newest_first=True, limit=1
        )
        week = Query(since=format_ts(time.time() - 7 * 86_400 - 1_234.5), op="seal")  # partial edge hour
        old_gate = Query(
            op="seal", kid="0ld0k1d0", outcome="ok", since=format_ts(time.time() - 3_660), newest_first=True, limit=1
        )
        out = {
            "gate": min(_timed(lambda: store.query(gate)) for _ in range(3)),
            "gate_quiet": min(_timed(lambda: store.query(old_gate)) for _ in range(3)),
            "token": min(_timed(lambda: list(store.iter_query(Query(fingerprint=fp)))) for _ in range(3)),
            "stats": min(_timed(lambda: store.stats("instance", Query())) for _ in range(3)),
            "stats_window": min(_timed(lambda: store.stats("reason", week)) for _ in range(3)),
            "stats_scan": _timed(lambda: store._scan_stats("instance", Query())),  # the anchor: a GROUP BY of every row
        }
    finally:
        store.close()
    out["kid_limit"] = min(
        _cli_seconds("audit", "query", "--audit", url, "--kid", "1a2b3c4d", "--limit", "20", "--json") for _ in range(2)
    )
    out["kid_rare"] = min(
        _cli_seconds("audit", "query", "--audit", url, "--kid", "0ld0k1d0", "--json") for _ in range(2)
    )
    return out


def _retire_gate(directory: Path) -> float:
    """Seconds of ``mrtr-keys rotate retire --json`` refused (exit 75: promote + TTL not yet passed)
    on a ring whose audit store is the filled log (``audit.db`` beside it), best of 2: the whole
    gate, presence rows and the sealing query included, and the CLI's start-up."""
    ring = str(directory / "keyring.json")
    for step in (("init",), ("rotate", "begin"), ("rotate", "promote")):
        _cli(*step, "--keystore", ring, "--json", codes=(0,))
    return min(_cli("rotate", "retire", "--keystore", ring, "--json", codes=(75,))[1] for _ in range(2))


def _cli_seconds(*args: str) -> float:
    _, seconds, _ = _cli(*args)
    return seconds


LOOKUPS = {
    "retire": "rotate retire (refused, CLI)",
    "gate": "rotate retire gate query (kid sealing)",
    "gate_quiet": "rotate retire gate query (kid quiet)",
    "token": "audit query --token (fingerprint lookup)",
    "kid_limit": "audit query --kid K --limit 20 (CLI)",
    "kid_rare": "audit query --kid RARE (CLI)",
    "stats": "audit stats --by instance (hourly totals)",
    "stats_window": "audit stats --by reason --since 7d --op seal (totals + edge hour)",
}


def run(services: Services, settings: Settings) -> list[Row]:
    env_sizes = os.environ.get("MRTR_KEYS_BENCH_AUDIT_SIZES")
    sizes = (
        [10_000, 40_000]
        if settings.quick
        else [int(s) for s in (env_sizes or "1000000,5000000").split(",") if s.strip()]
    )
    rows: list[Row] = []
    rss: dict[int, int] = {}
    looks: dict[int, dict[str, float]] = {}
    key_file = services.workdir / "audit-scale.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    KEY_ENV["MRTR_KEYS_AUDIT_KEY_FILE"] = str(key_file)
    for n in sizes:
        directory = services.workdir / f"audit-scale-{n}"
        directory.mkdir(exist_ok=True)
        db = directory / "audit.db"
        url = f"sqlite://{db}"
        started = time.perf_counter()
        fill(url, n, audit_key=key_file.read_bytes())
        fill_rate = n / (time.perf_counter() - started)
        size_mb = sum(p.stat().st_size for p in directory.glob("audit.db*")) / 2**20
        cps = str(directory / "checkpoints.jsonl")
        anchor = _bare_read(url)
        doc, seconds, peak = _cli("audit", "verify", "--audit", url, "--checkpoints", cps, "--json")
        if not doc.get("ok"):
            raise RuntimeError(f"verify of a genuine log failed: {doc.get('first_break')}")
        rss[n] = peak
        rate = n / seconds
        label = f"{n:,} events"
        rows.append(
            Row(PART, f"audit verify, {label}", "events/s", rate, anchor="bare paged read", ratio=rate / anchor).decide(
                rate / anchor, ">= 1.3x"
            )
        )
        rows[-1].note = (
            f"bare read {anchor:,.0f} rows/s; fill {fill_rate:,.0f} events/s; {seconds:.1f} s; "
            f"{doc.get('keyed'):,} records keyed"
        )
        rows.append(Row(PART, f"audit verify peak RSS, {label}", "MB", peak).decide(peak, "< 200 MB"))
        per_event = size_mb * 2**20 / n
        rows.append(
            Row(PART, f"bytes per event, {label}", "B", per_event, note=f"{size_mb:.0f} MB").decide(
                per_event, "<= 180 B"
            )
        )
        looks[n] = {**_lookups(url), "retire": _retire_gate(directory)}
        for key, name in LOOKUPS.items():
            rows.append(Row(PART, f"{name}, {label}", "ms", looks[n][key] * 1000))
        scan = looks[n]["stats_scan"]
        rows[-2].anchor = rows[-1].anchor = "GROUP BY over every row"
        rows[-2].ratio, rows[-1].ratio = looks[n]["stats"] / scan, looks[n]["stats_window"] / scan
        rows[-2].note = f"GROUP BY over every row: {scan * 1000:,.0f} ms"
        res, pseconds, ppeak = _cli("audit", "prune", "--before", "35d", "--audit", url, "--checkpoints", cps, "--json")
        deleted = int(res["deleted"])  # type: ignore[call-overload]
        rows.append(
            Row(PART, f"audit prune --before 35d, {label}", "events/s", deleted / pseconds, note=f"{deleted:,} deleted")
        )
        rows.append(Row(PART, f"audit prune peak RSS, {label}", "MB", ppeak).decide(ppeak, "< 200 MB"))
        archive_dir = str(directory / "archive")
        res, aseconds, apeak = _cli(
            "audit", "archive", "--before", "30d", "--audit", url, "--to", archive_dir, "--checkpoints", cps, "--json"
        )
        archived = int(res["archived"])  # type: ignore[call-overload]
        write_rate = float(res["write_records_per_second"] or 0)  # type: ignore[arg-type]
        rows.append(
            Row(PART, f"audit archive export (segments + manifest), {label}", "events/s", write_rate,
                anchor="bare paged read", ratio=write_rate / anchor).decide(write_rate, ">= 200000 events/s")
        )  # fmt: skip
        rows[-1].note = (
            f"{archived:,} archived in {res['segments']} segments, "
            f"{int(res['archive_bytes']) / max(archived, 1):.0f} B/event gzip"  # type: ignore[call-overload]
        )
        rows.append(
            Row(PART, f"audit archive --before 30d (walk + export + prune), {label}", "events/s", archived / aseconds,
                note=f"{aseconds:.1f} s; peak RSS {apeak} MB")
        )  # fmt: skip
        after, _, _ = _cli("audit", "verify", "--audit", url, "--checkpoints", cps, "--json")
        if not after.get("ok"):
            raise RuntimeError(f"verify after prune failed: {after.get('first_break')}")
        whole, wseconds, wpeak = _cli(
            "audit", "verify", "--audit", url, "--checkpoints", cps, "--from-archive", archive_dir, "--json"
        )
        if not whole.get("ok"):
            raise RuntimeError(f"verify --from-archive failed: {whole.get('first_break')}")
        total = int(whole["records"])  # type: ignore[call-overload]
        rows.append(
            Row(PART, f"audit verify --from-archive, {label}", "events/s", total / wseconds,
                note=f"{total:,} records ({archived:,} archived); peak RSS {wpeak} MB")
        )  # fmt: skip
        shutil.rmtree(archive_dir, ignore_errors=True)
        db.unlink()
        for extra in [
            *directory.glob("audit.db-*"),
            *directory.glob("keyring.json*"),
            *directory.glob("audit-*"),
            *directory.glob("audit.key"),
        ]:
            extra.unlink()
    if len(looks) >= 2:
        small, large = min(looks), max(looks)
        for key, name in LOOKUPS.items():
            growth = looks[large][key] / max(looks[small][key], 1e-6)
            rows.append(
                Row(PART, f"{name} growth, {large // small}x the events", "x", growth, ratio=growth).decide(
                    growth, "<= 2x"
                )
            )
    if len(rss) >= 2:
        small, large = min(rss), max(rss)
        growth = rss[large] / rss[small]
        rows.append(
            Row(PART, f"verify RSS growth, {large // small}x the events", "x", growth, ratio=growth).decide(
                growth, "<= 1.2x"
            )
        )
    rows += _postgres_verify(settings)
    return rows + audit_retention.run(services, settings)


def _postgres_verify(settings: Settings) -> list[Row]:
    """The verify rows of a PostgreSQL log (see the module docstring)."""
    from bench.single_use import _postgres

    env_sizes = os.environ.get("MRTR_KEYS_BENCH_AUDIT_PG_SIZES")
    sizes = [20_000] if settings.quick else [int(s) for s in (env_sizes or "1000000").split(",") if s.strip()]
    key = Path(KEY_ENV["MRTR_KEYS_AUDIT_KEY_FILE"]).read_bytes()
    rows: list[Row] = []
    for n in sizes:
        with _postgres() as url:
            started = time.perf_counter()
            fill(url, n, audit_key=key, span=2 * 86_400)
            fill_rate = n / (time.perf_counter() - started)
            anchor = _bare_read(url)
            doc, seconds, peak = _cli("audit", "verify", "--audit", url, "--checkpoints", "/nonexistent/cps", "--json")
            if not doc.get("ok"):
                raise RuntimeError(f"verify of a genuine PostgreSQL log failed: {doc.get('first_break')}")
            rate, label = n / seconds, f"{n:,} events, PostgreSQL"
            rows.append(
                Row(PART, f"audit verify, {label}", "events/s", rate, anchor="bare paged read",
                    ratio=rate / anchor).decide(rate / anchor, ">= 1.0x")
            )  # fmt: skip
            rows[-1].note = f"bare read {anchor:,.0f} rows/s; fill {fill_rate:,.0f} events/s; {seconds:.1f} s"
            rows.append(Row(PART, f"audit verify peak RSS, {label}", "MB", peak).decide(peak, "< 200 MB"))
    return rows
