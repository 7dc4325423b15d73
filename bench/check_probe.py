"""One sample of an audit row, measured by the ``mrtr_keys`` of the interpreter that runs this file (`bench.check`).

Run as a script (``python bench/check_probe.py ROW ...``) by the base revision's interpreter and by HEAD's, so
the same measuring code drives both packages. It imports nothing from ``bench`` or ``tests`` (the base
revision's would differ) and only public ``mrtr_keys`` names every release since 95b81a7 has (a moved module is
looked up at both places). Prints one JSON object on its last line.

Rows:

* ``inprocess N``: N local seal+unseal with the audit log off, then N with it on and its ``flush()`` inside the
  timed loop (the `bench.audit` row), GC paused; ``{"off_us", "on_us"}`` per operation (wall time).
* ``writer N``: N events (seal and unseal of real tokens) queued into a process-mode sink over a new SQLite
  store, then ``flush()``: ``{"events_per_s"}`` (the `bench.audit_writer` row).
* ``sidecar DIR on|off``: starts ``mrtr-keys serve`` (one worker, audit on or ``MRTR_KEYS_AUDIT=off``) on a ring
  of its own under DIR; prints ``{"url", "secret", "pid"}`` and serves until its stdin closes.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

PAYLOAD = json.dumps(
    {
        "v": 1,
        "iat": 1_785_230_400,
        "exp": 1_785_230_700,
        "method": "tools/call",
        "target": "deploy_service",
        "args": "sha256:" + "ab" * 32,
        "aud": "bench",
        "sub": "user-12345",
        "state": "x" * 80,
    },
    separators=(",", ":"),
).encode()
"""About 300 bytes shaped like the SDK's claims envelope (as `bench.common.envelope_payload`)."""
AUDIENCE = "bench"


def _attr(names: tuple[str, ...], attr: str) -> Any:
    for name in names:
        try:
            return getattr(importlib.import_module(name), attr)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"{attr} not found in {names}")


def _ring(directory: Path) -> Path:
    create_ring = _attr(("mrtr_keys.changes.create", "mrtr_keys.ring.create"), "create_ring")
    file_keystore = _attr(("mrtr_keys.keystores.file",), "FileKeystore")
    directory.mkdir(parents=True, exist_ok=True)
    ring = directory / "keyring.json"
    create_ring(file_keystore(ring))
    return ring


def _sink(codec: Any) -> Any:
    for holder in (codec, getattr(codec, "_core", None)):
        observer = getattr(holder, "_observer", None)
        if observer is not None and hasattr(observer, "sink"):
            return observer.sink
    raise RuntimeError("audit on, but no audit sink found on the codec")


def inprocess(n: int, directory: Path) -> dict[str, float]:
    from mrtr_keys import request_state_security

    ring = _ring(directory / "inprocess")
    off = request_state_security(ring, audience=AUDIENCE, audit=False).codec
    on = request_state_security(ring, audience=AUDIENCE, audit=None).codec
    sink = _sink(on)
    out: dict[str, float] = {}
    gc.disable()
    try:
        for name, codec in (("off_us", off), ("on_us", on)):
            seal, unseal = codec.seal, codec.unseal
            unseal(seal(PAYLOAD))
            sink.flush(60.0)
            started = time.perf_counter()
            for _ in range(n):
                unseal(seal(PAYLOAD))
            if codec is on:
                assert sink.flush(120.0)
            out[name] = (time.perf_counter() - started) / n * 1e6
    finally:
        gc.enable()
    if sink.dropped:
        raise RuntimeError(f"{sink.dropped} audit events dropped: not a valid sample")
    return out


def writer(n: int, directory: Path) -> dict[str, float]:
    # each where issue 38's move put it, then where 95b81a7 (the table's commit) has it
    item = _attr(("mrtr_keys.audit.capture.items", "mrtr_keys.audit.items"), "AuditItem")
    fingerprinter = _attr(("mrtr_keys.audit.writing.fingerprint", "mrtr_keys.audit.fingerprint"), "Fingerprinter")
    sink_class = _attr(("mrtr_keys.audit.capture.sink", "mrtr_keys.audit.sink"), "AuditSink")
    open_store = _attr(("mrtr_keys.audit.writing.stores.url", "mrtr_keys.audit.stores.url"), "open_store")
    local = _attr(("mrtr_keys.codecs.local",), "LocalAESGCMCodec")
    codec = local(_ring(directory / "writer-ring"), audience=AUDIENCE)
    now = time.time()
    items = []
    for i in range(n // 2):
        token = codec.seal(PAYLOAD)
        items.append(item("seal", "ok", "abcd1234", token, None, now + i * 1e-5, AUDIENCE, 1, "web", 0.05))
        items.append(item("unseal", "ok", "abcd1234", token, None, now + i * 1e-5, AUDIENCE, 1, "web", 0.07))
    url = f"sqlite://{directory}/writer.db"
    sink = sink_class(
        open_store(url), fingerprinter(os.urandom(32)), mode="process", url=url, capacity=4 * n, max_bytes=1 << 31
    )
    try:
        sink.submit(items[0])
        assert sink.flush(60)  # the writer process is up and connected before the clock runs
        submit = sink.submit
        started = time.perf_counter()
        for it in items:
            submit(it)
        assert sink.flush(600), sink.last_error
        elapsed = time.perf_counter() - started
        if sink.dropped:
            raise RuntimeError(f"{sink.dropped} audit events dropped: not a valid sample")
    finally:
        sink.close()
    return {"events_per_s": len(items) / elapsed}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sidecar(directory: Path, audit: str) -> None:
    ring = _ring(directory)
    env = {**os.environ, "MRTR_KEYS_KEYSTORE": str(ring)}
    if audit == "off":
        env["MRTR_KEYS_AUDIT"] = "off"
    cli = [sys.executable, "-m", "mrtr_keys.cli.main"]
    added = subprocess.run(
        [*cli, "clients", "add", "bench", "--audience", AUDIENCE, "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=directory,
    )
    secret = json.loads(added.stdout)["secret"]
    port = _free_port()
    args = ["serve", "--keystore", str(ring), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with open(directory / "serve.log", "wb") as log:
        proc = subprocess.Popen([*cli, *args], env=env, cwd=directory, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the sidecar did not start: see {directory / 'serve.log'}") from None
                time.sleep(0.1)
        print(json.dumps({"url": url, "secret": secret, "pid": proc.pid}), flush=True)
        sys.stdin.read()  # until the caller closes it
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str]) -> int:
    row = argv[0]
    if row == "sidecar":
        sidecar(Path(argv[1]), argv[2])
        return 0
    n, directory = int(argv[1]), Path(argv[2])
    result = inprocess(n, directory) if row == "inprocess" else writer(n, directory)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
