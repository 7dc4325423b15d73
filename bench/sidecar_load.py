"""Part 3: the sidecar over loopback HTTP against OpenBao transit, both driven by the same wrk.

Load generator: wrk (Debian package ``wrk``; installed here with apt-get when missing and
running as root), one thread, keep-alive connections, a Lua script per scenario that sets
the POST body and headers. wrk's own CPU use (user+system from `os.wait4`, as a share of
one core) is reported beside each number, since on a 2-core box it competes with the server.

Sidecar: ``mrtr-keys serve`` on a local key ring, default settings except ``--workers``
(`SIDECAR_WORKERS`), a client made with ``mrtr-keys clients add``. Seal counting (issue 36) is on, as by
default; one pair compares it with a second sidecar started with ``MRTR_KEYS_SEAL_COUNTS=off``, interleaved.
Anchor: the OpenBao dev server's transit ``encrypt``/``decrypt`` on a plain aes256-gcm96 key (not derived: the
cheapest transit path, so the comparison favours the anchor). Runs are interleaved
(sidecar, OpenBao, sidecar, OpenBao, ...) and medians taken over the repeats.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.services import add_client_cli, start_sidecar_process

from bench.common import Settings, envelope_payload
from bench.report import Row, spread_of
from bench.services import AUDIENCE, VAULT_TOKEN, Services, module_available
from bench.timing import median, paired_ratio

PART = "sidecar_load"
SIDECAR_WORKERS = 2
BATCH = 100
CONCURRENCY = (1, 16, 64)
CLI = [sys.executable, "-m", "mrtr_keys.cli.main"]


@dataclass
class WrkResult:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    wrk_cpu: float  # share of one core, 0..1+


@dataclass
class Sidecar:
    url: str
    secret: str
    pid: int


def ensure_wrk() -> str | None:
    """Path of wrk, installing Debian's package when missing and allowed (root, apt-get). None if unavailable."""
    path = shutil.which("wrk")
    if path:
        return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("[bench] installing wrk with apt-get", file=sys.stderr)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env, "check": False}
        if subprocess.run(["apt-get", "install", "-y", "wrk"], **quiet).returncode != 0:  # type: ignore[call-overload]
            subprocess.run(["apt-get", "update"], **quiet)  # type: ignore[call-overload]
            subprocess.run(["apt-get", "install", "-y", "wrk"], **quiet)  # type: ignore[call-overload]
    return shutil.which("wrk")


def start_sidecar(
    services: Services,
    *,
    workers: int = SIDECAR_WORKERS,
    name: str = "sidecar",
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Sidecar:
    """A local ring, a bench client, and ``mrtr-keys serve`` on a free port (stopped by `services.close()`);
    `env` adds to its environment (``MRTR_KEYS_AUDIT=off``, say)."""
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.keystores.file import FileKeystore

    home = services.workdir / name  # its own directory: the client registry lives beside the ring
    home.mkdir()
    ring = home / "keyring.json"
    create_ring(FileKeystore(ring))
    secret = add_client_cli(ring, "bench", AUDIENCE)
    service = start_sidecar_process(
        ring,
        workdir=home,
        args=["--workers", str(workers), "--reload-interval", "60", *extra],
        env=env,
        ready_path="/readyz",
    )
    services.track(service.proc)
    return Sidecar(service.url, secret, service.proc.pid)


def _wait_ready(sidecar: Sidecar) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(sidecar.url + "/readyz", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("sidecar not ready")


def post(url: str, body: Any, headers: dict[str, str]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    for k, v in headers.items():
        req.add_header(k, v)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def lua_script(directory: Path, name: str, body: Any, headers: dict[str, str]) -> Path:
    """A wrk script that POSTs `body` (JSON) with `headers`; Lua long strings keep the JSON verbatim."""
    text = json.dumps(body, separators=(",", ":"))
    lines = ['wrk.method = "POST"', f"wrk.body = [==[{text}]==]", 'wrk.headers["Content-Type"] = "application/json"']
    lines += [f'wrk.headers["{k}"] = [==[{v}]==]' for k, v in headers.items()]
    path = directory / f"{name}.lua"
    path.write_text("\n".join(lines) + "\n")
    return path


_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _latency_ms(text: str, pct: str) -> float:
    m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M)
    if m is None:
        raise ValueError(f"no {pct}% latency in wrk output")
    return float(m.group(1)) * _UNIT[m.group(2)]


def run_wrk(wrk: str, url: str, script: Path, *, connections: int, seconds: float) -> WrkResult:
    """One wrk run (1 thread, `connections` keep-alive connections); parses req/s, p50, p99, errors."""
    cmd = [wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script), url]
    with tempfile.TemporaryFile() as out:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {text[-300:]}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))  # type: ignore[union-attr]
    errors = 0
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    if m:
        errors += int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if m:
        errors += sum(int(g) for g in m.groups())
    cpu = (usage.ru_utime + usage.ru_stime) / wall
    return WrkResult(rps, _latency_ms(text, "50"), _latency_ms(text, "99"), errors, cpu)


@dataclass
class Scenario:
    name: str
    url: str
    script: Path
    connections: int
    items: int = 1


def _ab(wrk: str, a: Scenario, b: Scenario, settings: Settings) -> tuple[list[WrkResult], list[WrkResult]]:
    ra: list[WrkResult] = []
    rb: list[WrkResult] = []
    for r in range(settings.wrk_repeats):
        order = [(a, ra), (b, rb)] if r % 2 == 0 else [(b, rb), (a, ra)]
        for sc, sink in order:
            sink.append(run_wrk(wrk, sc.url, sc.script, connections=sc.connections, seconds=settings.wrk_seconds))
    return ra, rb


def _note(results: list[WrkResult]) -> str:
    p50 = median([r.p50_ms for r in results])
    p99 = median([r.p99_ms for r in results])
    errors = sum(r.errors for r in results)
    cpu = median([r.wrk_cpu for r in results]) * 100
    text = f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, wrk CPU {cpu:.0f}%"
    return text + (f", {errors} errors" if errors else "")


COUNTING_ON = "sidecar seal c=16, seal counting on"
COUNTING_OFF = "sidecar seal c=16, seal counting off"


def _counting_rows(wrk: str, services: Services, settings: Settings) -> list[Row]:
    """Seal counting on (as by default: per-kid counters, reservations written to the audit store's key_usage)
    against off (``MRTR_KEYS_SEAL_COUNTS=off``): two sidecars started together for this pair, so neither carries
    the audit log the other scenarios grew, interleaved."""
    payload = envelope_payload()
    sides = []
    for name, env in (("sidecar-counted", None), ("sidecar-uncounted", {"MRTR_KEYS_SEAL_COUNTS": "off"})):
        sidecar = start_sidecar(services, name=name, env=env)
        auth = {"Authorization": f"Bearer {sidecar.secret}"}
        body = {"audience": AUDIENCE, "payload": b64u(payload)}
        sides.append((sidecar, lua_script(services.workdir, f"seal-{name}", body, auth)))
    (on_side, on_script), (off_side, off_script) = sides
    on = Scenario(COUNTING_ON, on_side.url + "/v1/seal", on_script, 16)
    off = Scenario(COUNTING_OFF, off_side.url + "/v1/seal", off_script, 16)
    r_on, r_off = _ab(wrk, on, off, settings)
    s_on, s_off = [r.rps for r in r_on], [r.rps for r in r_off]
    base = Row(PART, COUNTING_OFF, "req/s", median(s_off), spread_of(s_off), note=_note(r_off), samples=s_off)
    row = Row(PART, COUNTING_ON, "req/s", median(s_on), spread_of(s_on), COUNTING_OFF, paired_ratio(s_on, s_off))
    row.samples = s_on
    row.note = (
        _note(r_on) + "; off: MRTR_KEYS_SEAL_COUNTS=off, no reservations written and the counters a no-op call "
        "(the per-token code alone: inprocess 'seal counting')"
    )
    if any(r.errors for r in r_on + r_off):
        row.note += " (non-2xx or socket errors: numbers not valid)"
    return [base, row.decide(row.ratio, ">= 0.95x")]


def run(services: Services, settings: Settings) -> list[Row]:
    targets = {"seal c=16": ">= 2x", "seal c=16 p99": "<= 0.25x", "batch": ">= 2x"}
    if not module_available("mrtr_keys.service.app"):
        return [
            Row.missing(PART, f"sidecar {k}", "n/a (not built): mrtr_keys.service", target=v)
            for k, v in targets.items()
        ]
    wrk = ensure_wrk()
    if wrk is None:
        why = "n/a: wrk not installed (apt-get install -y wrk)"
        return [Row.missing(PART, f"sidecar {k}", why, target=v) for k, v in targets.items()]
    sidecar = start_sidecar(services)
    bao = services.bao
    bao.request("POST", "/v1/transit/keys/bench-http", {"type": "aes256-gcm96"})
    payload = envelope_payload()
    auth = {"Authorization": f"Bearer {sidecar.secret}"}
    vault = {"X-Vault-Token": VAULT_TOKEN}
    token = post(sidecar.url + "/v1/seal", {"audience": AUDIENCE, "payload": b64u(payload)}, auth)["token"]
    plaintext = base64.b64encode(payload).decode()
    ciphertext = bao.request("POST", "/v1/transit/encrypt/bench-http", {"plaintext": plaintext})["data"]["ciphertext"]
    d = services.workdir
    scripts = {
        "seal": lua_script(d, "seal", {"audience": AUDIENCE, "payload": b64u(payload)}, auth),
        "unseal": lua_script(d, "unseal", {"audience": AUDIENCE, "token": token}, auth),
        "encrypt": lua_script(d, "encrypt", {"plaintext": plaintext}, vault),
        "decrypt": lua_script(d, "decrypt", {"ciphertext": ciphertext}, vault),
        "seal-batch": lua_script(
            d, "seal-batch", {"items": [{"audience": AUDIENCE, "payload": b64u(payload)}] * BATCH}, auth
        ),
        "unseal-batch": lua_script(
            d, "unseal-batch", {"items": [{"audience": AUDIENCE, "token": token}] * BATCH}, auth
        ),
        "encrypt-batch": lua_script(d, "encrypt-batch", {"batch_input": [{"plaintext": plaintext}] * BATCH}, vault),
        "decrypt-batch": lua_script(d, "decrypt-batch", {"batch_input": [{"ciphertext": ciphertext}] * BATCH}, vault),
    }
    s_url, b_url = sidecar.url, bao.addr
    pairs: list[tuple[Scenario, Scenario]] = []
    for c in CONCURRENCY:
        pairs.append(
            (
                Scenario(f"sidecar seal c={c}", s_url + "/v1/seal", scripts["seal"], c),
                Scenario(f"OpenBao encrypt c={c}", b_url + "/v1/transit/encrypt/bench-http", scripts["encrypt"], c),
            )
        )
        pairs.append(
            (
                Scenario(f"sidecar unseal c={c}", s_url + "/v1/unseal", scripts["unseal"], c),
                Scenario(f"OpenBao decrypt c={c}", b_url + "/v1/transit/decrypt/bench-http", scripts["decrypt"], c),
            )
        )
    batch_c = 16
    pairs.append(
        (
            Scenario(
                f"sidecar seal batch({BATCH}) c={batch_c}",
                s_url + "/v1/seal/batch",
                scripts["seal-batch"],
                batch_c,
                BATCH,
            ),
            Scenario(
                f"OpenBao encrypt batch({BATCH}) c={batch_c}",
                b_url + "/v1/transit/encrypt/bench-http",
                scripts["encrypt-batch"],
                batch_c,
                BATCH,
            ),
        )
    )
    pairs.append(
        (
            Scenario(
                f"sidecar unseal batch({BATCH}) c={batch_c}",
                s_url + "/v1/unseal/batch",
                scripts["unseal-batch"],
                batch_c,
                BATCH,
            ),
            Scenario(
                f"OpenBao decrypt batch({BATCH}) c={batch_c}",
                b_url + "/v1/transit/decrypt/bench-http",
                scripts["decrypt-batch"],
                batch_c,
                BATCH,
            ),
        )
    )
    rows: list[Row] = []
    for subject, anchor in pairs:
        rs, ra = _ab(wrk, subject, anchor, settings)
        unit = "items/s" if subject.items > 1 else "req/s"
        s_rate = [r.rps * subject.items for r in rs]
        a_rate = [r.rps * anchor.items for r in ra]
        rows.append(Row(PART, anchor.name, unit, median(a_rate), spread_of(a_rate), note=_note(ra), samples=a_rate))
        row = Row(
            PART, subject.name, unit, median(s_rate), spread_of(s_rate), anchor.name, paired_ratio(s_rate, a_rate)
        )
        row.note, row.samples = _note(rs), s_rate
        if subject.name == "sidecar seal c=16" or subject.items > 1:
            row.decide(row.ratio, ">= 2x")
        if any(r.errors for r in rs + ra):
            row.status = "MISS" if row.target else row.status
            row.note += " (non-2xx or socket errors: numbers not valid)"
        rows.append(row)
        if subject.name == "sidecar seal c=16":
            p_s = [r.p99_ms for r in rs]
            p_a = [r.p99_ms for r in ra]
            p99 = Row(PART, "sidecar seal c=16 p99", "ms", median(p_s), spread_of(p_s), "OpenBao encrypt c=16 p99")
            p99.ratio = paired_ratio(p_s, p_a)
            p99.note = f"OpenBao p99 {median(p_a):.2f} ms"
            rows.append(p99.decide(p99.ratio, "<= 0.25x"))
    rows.extend(_counting_rows(wrk, services, settings))
    rows.append(
        Row(
            PART,
            "sidecar workers",
            "",
            float(SIDECAR_WORKERS),
            note="uvicorn worker processes; wrk -t1 on the same box",
        )
    )
    return rows
