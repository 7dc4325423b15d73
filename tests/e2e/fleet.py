"""The fleet round trip, reusable by every codec's tests: round 1 on server A, the retry on server B.

Two ``python -m mrtr_keys.example`` processes (uvicorn, streamable HTTP, free 127.0.0.1 ports) share one
keystore. Server A answers ``provision`` with an `InputRequiredResult` whose ``requestState`` it sealed;
server B, a different process, gets the retry (same arguments, the answer, the same ``requestState``).
With a shared key ring B unseals A's token and answers; with the SDK's default key (each process its
own ephemeral key) B refuses with -32602 "Invalid or expired requestState".

Use it from any codec's tests, after creating the codec's key ring and starting its services:

    from tests.e2e.fleet import run_fleet_round_trip

    def test_kms_fleet(kms_keystore_path, moto_env, tmp_path):
        result = run_fleet_round_trip(kms_keystore_path, "provisioner", env=moto_env, log_dir=tmp_path)
        assert result.accepted, result.explain()
        assert result.text == "Provisioned 'orders' in eu-west-1. (served by B)"

- `env`: extra environment for both server processes (AWS endpoint and credentials for moto, VAULT_ADDR
  and VAULT_TOKEN for OpenBao, ...).
- `key_args`: the key-source flags (default ``--codec-from-ring``: `mrtr_keys.request_state_security`
  opens the codec the ring records); ``SDK_DEFAULT_KEY`` for the negative test; a sidecar passes
  ``("--sidecar", url, "--secret", secret)`` once the example server has that option.
- `server_args`: any other flags for both servers (e.g. ``("--ttl", "300")``).
- `keystore_path` may be None when the key source needs none (MRTR_KEYS_KEYSTORE in `env` still applies).

It never raises for a refused retry: the outcome is in the returned `FleetResult` (`accepted`, `text`,
`error`), so both a positive and a negative test can assert on it. Both processes are always stopped.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from mcp.shared.exceptions import MCPError

from tests.e2e.servers import RING_KEY, ServerPool, first_round, retry_round, text_of

INVALID_REQUEST_STATE = (-32602, "Invalid or expired requestState")
"""The SDK's frozen answer to every requestState that fails verification (code, message)."""


@dataclass
class FleetResult:
    """What the client saw across the two servers."""

    request_state: str
    """The sealed token server A returned in round 1 (what went on the wire)."""
    text: str | None
    """Server B's final tool text, if it accepted the retry."""
    error: MCPError | None
    """Server B's refusal, if it refused the retry."""
    control_text: str | None = None
    """With ``control=True``: server A's answer to the same retry (a process always accepts its own token)."""
    logs: dict[str, str] = field(default_factory=dict)
    """Output of each server process, by instance label ("A", "B")."""
    starts: int = 2
    """Server processes started: 2, plus one for each restart on a new port after the first found its port
    taken (`ServerPool.wait_ready`); each start opens the key ring, so per-process costs count per start."""

    @property
    def accepted(self) -> bool:
        return self.error is None and self.text is not None

    @property
    def error_code_and_message(self) -> tuple[int, str] | None:
        return None if self.error is None else (self.error.code, self.error.message)

    def explain(self) -> str:
        """A readable summary for assertion messages (tokens shortened, no key material)."""
        logs = "\n".join(f"--- server {k} ---\n{v[-3000:]}" for k, v in self.logs.items())
        return f"token {self.request_state[:16]}..., text={self.text!r}, error={self.error!r}\n{logs}"


def run_fleet_round_trip(
    keystore_path: str | os.PathLike[str] | None,
    audience: str = "provisioner",
    *,
    env: Mapping[str, str] | None = None,
    key_args: Sequence[str] = RING_KEY,
    server_args: Sequence[str] = (),
    name: str = "orders",
    region: str = "eu-west-1",
    control: bool = False,
    log_dir: str | os.PathLike[str] | None = None,
) -> FleetResult:
    """Round 1 on server A, retry on server B (separate processes, same keystore and flags).

    Args:
        keystore_path: the shared key ring (path or URL), or None to let the servers resolve it.
        audience: both servers' name and requestState audience.
        env: extra environment for both processes.
        key_args: key-source flags for both servers (see the module docstring).
        server_args: other flags for both servers.
        name, region: the tool argument and the answer to its question.
        control: also send the same retry back to server A (`FleetResult.control_text`), proving the
            token itself was good when B refuses it.
        log_dir: where the servers' output goes (default: a new temporary directory).

    Returns:
        The `FleetResult`; a refusal by B is a result, not an exception.

    Raises:
        AssertionError: round 1 did not return an `InputRequiredResult`.
        RuntimeError, TimeoutError: a server did not start (its output is in the message).
    """
    directory = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="mrtr-fleet-"))
    with ServerPool(directory / "fleet", env=env) as pool:
        a, b = (
            pool.launch(
                keystore=keystore_path, audience=audience, instance=i, key_args=key_args, extra_args=server_args
            )
            for i in ("A", "B")
        )
        pool.wait_ready()

        async def rounds() -> FleetResult:
            first = await first_round(a.url, name)
            token = first.request_state or ""
            text: str | None = None
            error: MCPError | None = None
            try:
                text = text_of(await retry_round(b.url, first.request_state, region, name))
            except MCPError as exc:
                error = exc
            result = FleetResult(request_state=token, text=text, error=error)
            if control:
                result.control_text = text_of(await retry_round(a.url, first.request_state, region, name))
            return result

        try:
            result = anyio.run(rounds)
        finally:
            pool.close()
        result.logs = {"A": a.output(), "B": b.output()}
        result.starts = 2 + a.retries + b.retries
        return result
