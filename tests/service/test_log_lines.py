"""What a flood of bad requests writes to the server log: bounded, one line each, no traceback.

A client sending bad tokens as fast as it can got one log line per token; with ``strict_audit`` and the
audit store down, every refused request logged a whole traceback. Now the rejected-unseal lines and the
audit-failure lines go through `RateLimitedLog` (at most 20 a second, then one summary line), and an audit
failure is one line naming the exception. The app runs in process over a real ring; the failing audit sink
is a plain function that raises, as a store that cannot be written makes the real sink do.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from mrtr_keys.changes.create import create_ring
from mrtr_keys.errors import AuditError
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.service.app import create_app
from mrtr_keys.service.clients import add_client
from mrtr_keys.service.config import ServiceConfig
from mrtr_keys.service.ratelog import RateLimitedLog

LOGGER = "mrtr_keys.service"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _app(root: Path, audit: Any, clock: Clock, **settings: Any) -> tuple[TestClient, dict[str, str]]:
    """The app, its rate limiters on `clock` (so the test does not depend on how fast this machine is)."""
    ring = root / "keyring.json"
    create_ring(FileKeystore(ring))
    _, secret = add_client(root / "clients.json", "app", audiences=["app"])
    app = create_app(ServiceConfig(**settings), keystore=str(ring), audit=audit)
    app.core._rejected_log._clock = clock
    app.core._audit_log._clock = clock
    return TestClient(app), {"authorization": f"Bearer {secret}"}


def _lines(caplog: pytest.LogCaptureFixture, needle: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and needle in r.getMessage()]


def test_rejected_unseal_lines_are_rate_limited(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    client, auth = _app(tmp_path, lambda **event: None, clock)
    caplog.set_level(logging.INFO, logger=LOGGER)
    for i in range(200):  # within one second
        r = client.post("/v1/unseal", json={"audience": "app", "token": f"mk1.bad{i}"}, headers=auth)
        assert (r.status_code, r.json()) == (400, {"error": "invalid_token"})  # every one still answered
    assert len(_lines(caplog, "unseal rejected")) == 20
    clock.now += 1.0
    client.post("/v1/unseal", json={"audience": "app", "token": "mk1.late"}, headers=auth)
    assert [r.getMessage() for r in _lines(caplog, "rejected-unseal")] == [
        "180 more rejected-unseal log lines suppressed (rate limit)"
    ]
    assert len(_lines(caplog, "unseal rejected")) == 21


def test_strict_audit_refusals_log_one_line_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def down(**event: Any) -> None:
        raise AuditError("the audit store cannot be written: connection refused")

    client, auth = _app(tmp_path, down, Clock(), strict_audit=True)
    caplog.set_level(logging.INFO, logger=LOGGER)
    for _ in range(100):
        r = client.post("/v1/seal", json={"audience": "app", "payload": "aGk"}, headers=auth)
        assert (r.status_code, r.json()) == (503, {"error": "audit_unavailable"})
    lines = _lines(caplog, "audit sink failed")
    assert len(lines) == 20 and all(r.exc_info is None for r in lines)
    assert lines[0].getMessage() == (
        "audit sink failed, request refused (strict_audit): AuditError: "
        "the audit store cannot be written: connection refused"
    )
    assert "\n" not in lines[0].getMessage()


def test_the_limiter_lets_a_burst_through_then_summarises(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("tests.ratelog"), "things", burst=3, interval=1.0, clock=clock)
    caplog.set_level(logging.INFO, logger="tests.ratelog")
    for i in range(10):
        log("thing %d", i)
    clock.now += 1.0
    log("thing %d", 10)
    assert [r.getMessage() for r in caplog.records] == [
        "thing 0",
        "thing 1",
        "thing 2",
        "7 more things log lines suppressed (rate limit)",
        "thing 10",
    ]
