"""Connection limits of a real sidecar process: bounded slowloris, a 100 MB header, the cap.

Before these limits, connections sending nothing, a partial head, a short body or an unfinished chunked
body were held open indefinitely, and one 100 MB header stalled every client for seconds (beyond the 2 s
timeout of `SidecarCodec`). Bounded: at most ~100 connections, a 100 MB header at most, loopback only.
The settings come from a config file (``http = "httptools"`` in one, the default ``corked`` in the other),
so both protocols and the file's keys are exercised.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.codecs.sidecar_client import SidecarCodec
from tests.fixtures.common import run_cli
from tests.fixtures.sidecar import Sidecar

TIMEOUT = 1.0
"""header_timeout and body_timeout of these sidecars (seconds; the default is 5)."""
SWEEP = 0.5
"""Deadlines are checked every SWEEP seconds (`mrtr_keys.service.protocol.SWEEP_SECONDS`)."""
STALLS = {
    "nothing": "",
    "partial head": "POST /v1/seal HTTP/1.1\r\nhost: t\r\nx-slow: ",
    "short body": "POST /v1/seal HTTP/1.1\r\nhost: t\r\n{auth}content-length: 100\r\n\r\n0123456789",
    "unfinished chunked": "POST /v1/seal HTTP/1.1\r\nhost: t\r\n{auth}transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
}
"""What the four kinds of stalled client send (with a valid secret, so the sidecar waits for the body)."""


def _start(sidecar_factory: Any, keystore_path: Path, tmp_path: Path, settings: str) -> Sidecar:
    cfg = tmp_path / f"sidecar-{time.monotonic_ns()}.toml"
    cfg.write_text(f"[sidecar]\nheader_timeout = {TIMEOUT}\nbody_timeout = {TIMEOUT}\n{settings}\n")
    sidecar: Sidecar = sidecar_factory(keystore_path, extra=["--config", str(cfg)])
    return sidecar


def _port(sidecar: Sidecar) -> int:
    return int(sidecar.url.rsplit(":", 1)[1])


def _closed_after(s: socket.socket) -> tuple[float, bytes]:
    """Seconds until the server closes `s` (at most 15), and what it sent before."""
    return _watch([s])[s]


def _watch(socks: list[socket.socket], opened: dict[socket.socket, float] | None = None) -> dict[Any, Any]:
    """For each socket: (seconds from `opened` (else now) until the server closed it, at most 15; bytes sent)."""
    t0 = time.monotonic()
    start = opened or dict.fromkeys(socks, t0)
    data: dict[socket.socket, bytes] = dict.fromkeys(socks, b"")
    out: dict[socket.socket, tuple[float, bytes]] = {}
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    while len(out) < len(socks) and time.monotonic() - t0 < 15:
        for key, _ in sel.select(timeout=0.1):
            s = key.fileobj  # type: ignore[assignment]
            try:
                chunk = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if chunk:
                data[s] += chunk
            else:
                out[s] = (time.monotonic() - start[s], data[s])
                sel.unregister(s)
    for s in socks:
        out.setdefault(s, (15.0, data[s]))
    sel.close()
    return out


def test_stalled_connections_are_closed_within_the_timeout_while_clients_are_served(
    keystore_path: Path, tmp_path: Path, sidecar_factory: Any
) -> None:
    sidecar = _start(sidecar_factory, keystore_path, tmp_path, 'http = "httptools"')
    assert "http httptools" in sidecar.output()
    secret = sidecar.add_client("app", ["app"])
    codec = sidecar.codec("app", secret)
    auth = f"authorization: Bearer {secret}\r\n"
    held: list[tuple[str, socket.socket]] = []
    opened: dict[socket.socket, float] = {}
    for i in range(80):  # 20 of each kind, held at once
        kind = list(STALLS)[i % 4]
        s = socket.create_connection(("127.0.0.1", _port(sidecar)), timeout=15)
        opened[s] = time.monotonic()
        if STALLS[kind]:
            s.sendall(STALLS[kind].format(auth=auth).encode())
        held.append((kind, s))
    for i in range(20):  # legitimate traffic meanwhile
        assert codec.unseal(codec.seal(b"state %d" % i)) == b"state %d" % i
    closed = _watch([s for _, s in held], opened)
    results: dict[str, list[tuple[float, bytes]]] = {kind: [] for kind in STALLS}
    for kind, s in held:
        results[kind].append(closed[s])
        s.close()
    for kind, closes in results.items():
        worst = max(t for t, _ in closes)
        assert worst <= TIMEOUT + SWEEP + 1.5, (kind, worst)  # + sweep period + a loaded machine's slack
    assert all(data.startswith(b"HTTP/1.1 408 ") for _, data in results["partial head"])
    assert all(data == b"" for kind in ("nothing", "short body", "unfinished chunked") for _, data in results[kind])
    assert codec.unseal(codec.seal(b"after")) == b"after"


def test_a_100_mb_header_is_cut_off_and_sealing_goes_on_within_the_codec_timeout(
    keystore_path: Path, tmp_path: Path, sidecar_factory: Any
) -> None:
    sidecar = _start(sidecar_factory, keystore_path, tmp_path, "max_header_bytes = 32768")
    secret = sidecar.add_client("app", ["app"])
    codec = SidecarCodec(sidecar.url, audience="app", secret=secret)
    codec.seal(b"warm")
    big = socket.create_connection(("127.0.0.1", _port(sidecar)), timeout=15)
    big.sendall(b"POST /v1/seal HTTP/1.1\r\nhost: t\r\nx-big: ")
    outcome: dict[str, Any] = {}

    def flood() -> None:
        sent = 0
        try:
            for _ in range(100):
                big.sendall(b"a" * (1 << 20))
                sent += 1
        except OSError as exc:
            outcome["error"] = type(exc).__name__
        outcome["sent_mb"] = sent

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    seals = 0
    while t.is_alive() and seals < 200:
        # with SidecarCodec's default 2 s timeout, a stalled server raises BackendUnavailable here
        assert codec.unseal(codec.seal(b"x")) == b"x"
        seals += 1
    t.join(20)
    assert not t.is_alive()
    assert "error" in outcome and outcome["sent_mb"] < 100, outcome
    big.close()


def test_connections_beyond_the_cap_get_503_too_many_connections(
    keystore_path: Path, tmp_path: Path, sidecar_factory: Any
) -> None:
    sidecar = _start(sidecar_factory, keystore_path, tmp_path, "max_connections = 20")
    assert "at most 20 connections" in sidecar.output()
    secret = sidecar.add_client("app", ["app"])
    held = [socket.create_connection(("127.0.0.1", _port(sidecar)), timeout=15) for _ in range(20)]
    try:
        extra = socket.create_connection(("127.0.0.1", _port(sidecar)), timeout=15)
        extra.sendall(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
        _, answer = _closed_after(extra)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503 ") and answer.endswith(b'{"error":"too_many_connections"}')
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while sidecar.http(secret).get("/healthz").status_code != 200:  # freed slots serve again
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "env", "config"),
    [(["--http", "plain"], {}, ""), ([], {"MRTR_KEYS_HTTP": "plain"}, ""), ([], {}, 'http = "plain"')],
)
def test_the_http_setting_is_read_from_the_flag_the_environment_and_the_file(
    keystore_path: Path, tmp_path: Path, args: list[str], env: dict[str, str], config: str
) -> None:
    """``--http``, ``MRTR_KEYS_HTTP`` and the file's ``http`` all reach the checked setting (corked | httptools)."""
    if config:
        cfg = tmp_path / "s.toml"
        cfg.write_text(f"[sidecar]\n{config}\n")
        args = ["--config", str(cfg)]
    r = run_cli("serve", *args, keystore=keystore_path, env=env)
    assert r.code == 2 and r.err.strip() == "mrtr-keys: http must be one of corked, httptools", r.err


def test_by_default_a_stalled_connection_is_closed_within_10_s() -> None:
    """The defaults (5 s for a head, 5 s for a body, checked every 0.5 s, 8 s kept alive idle)."""
    from mrtr_keys.service.config import ServiceConfig
    from mrtr_keys.service.protocol import SWEEP_SECONDS, ConnectionLimits

    config = ServiceConfig()
    limits = ConnectionLimits.from_config(config)
    assert limits == ConnectionLimits()
    assert max(config.header_timeout, config.body_timeout, config.keep_alive_timeout) + SWEEP_SECONDS <= 10
    assert config.keep_alive_timeout > 5.0  # longer than httpx's pool expiry: SidecarCodec never reuses a closed one


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("header_timeout", 0),
        ("body_timeout", float("nan")),
        ("keep_alive_timeout", 1e9),
        ("max_header_bytes", 10),
        ("max_connections", 0),
        ("max_connections_per_peer", 0),
        ("write_timeout", float("inf")),
        ("http", "h2"),
    ],
)
def test_limit_settings_out_of_range_are_refused(name: str, value: object) -> None:
    from mrtr_keys.errors import ConfigError
    from mrtr_keys.service.config import ServiceConfig

    with pytest.raises(ConfigError, match=name):
        ServiceConfig(**{name: value})  # type: ignore[arg-type]
