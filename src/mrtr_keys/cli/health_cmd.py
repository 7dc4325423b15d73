"""`mrtr-keys health [--ready]`: ask a running sidecar whether it is alive (``/healthz``) or ready
(``/readyz``), for container HEALTHCHECKs, exec probes and scripts (exit 0 healthy, 1 not)."""

from __future__ import annotations

from typing import Annotated

import typer

from mrtr_keys.cli.options import JsonOpt
from mrtr_keys.errors import ConfigError, MrtrKeysError

DEFAULT_URL = "http://127.0.0.1:8750"
"""Without --url or MRTR_KEYS_SIDECAR_URL: this host, port MRTR_KEYS_PORT (as `serve` reads it) or 8750."""


def health(
    url: Annotated[
        str | None,
        typer.Option(
            "--url",
            envvar="MRTR_KEYS_SIDECAR_URL",
            help="Sidecar URL: http://HOST:PORT or unix:///PATH [default: http://127.0.0.1:$MRTR_KEYS_PORT, "
            "else port 8750].",
            show_default=False,
        ),
    ] = None,
    ready: Annotated[bool, typer.Option("--ready", help="Check readiness (/readyz) instead of liveness.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for one answer.")] = 2.0,
    wait: Annotated[
        float, typer.Option("--wait", help="Keep asking for up to this many seconds (a sidecar still starting).")
    ] = 0.0,
    json_: JsonOpt = False,
) -> None:
    """Exit 0 if the sidecar answers 200 on /healthz (or /readyz with --ready), else 1 with the reason."""
    import os
    import time

    from mrtr_keys.cli.output import print_json, print_line
    from mrtr_keys.codecs.sidecar_transport import sidecar_transport

    if not 0 < timeout <= 300:  # NaN too: httpx and time.sleep raised ValueError, an internal error
        raise ConfigError("--timeout must be a number of seconds above 0 and at most 300")
    if not 0 <= wait <= 86400:
        raise ConfigError("--wait must be a number of seconds from 0 to 86400")
    port = os.environ.get("MRTR_KEYS_PORT")
    target = url or (f"http://127.0.0.1:{port}" if port else DEFAULT_URL)
    sidecar_transport(target)  # a bad URL is a usage error at once, not after --wait
    path = "/readyz" if ready else "/healthz"
    deadline = time.monotonic() + max(0.0, wait)
    while True:
        try:
            _check(target, path, ready, timeout)
            break
        except MrtrKeysError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
    from mrtr_keys.urls import redact

    shown = redact(target)  # a password in the URL's userinfo is never printed
    if json_:
        print_json({"url": shown, "path": path, "status": 200})
    else:
        print_line(f"ok: {shown}{path} answered 200")


def _check(target: str, path: str, ready: bool, timeout: float) -> None:
    """One request; raises `MrtrKeysError` (exit 1) unless the answer is 200."""
    import httpx

    from mrtr_keys.codecs.sidecar_transport import sidecar_transport
    from mrtr_keys.urls import redact

    base, transport = sidecar_transport(target)
    target = redact(target)  # for the messages below
    try:
        with httpx.Client(base_url=base, transport=transport, timeout=timeout) as client:
            response = client.get(path)
    except httpx.HTTPError as exc:
        raise MrtrKeysError(f"sidecar at {target} did not answer {path}: {type(exc).__name__}") from None
    if response.status_code != 200:
        detail = ""
        try:
            detail = str(response.json().get("reason") or "")
        except ValueError:
            pass
        raise MrtrKeysError(
            f"sidecar at {target} is not {'ready' if ready else 'healthy'}: HTTP {response.status_code}"
            + (f" ({detail})" if detail else "")
        )
