"""The deploy tests' one fixture: a `Sandbox` (the deploy files run as uid 10001), stopped after the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.deploy.sandbox import Sandbox


@pytest.fixture
def box() -> Iterator[Sandbox]:
    sandbox = Sandbox()
    try:
        yield sandbox
    finally:
        sandbox.stop()
