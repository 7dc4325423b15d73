"""The TypeScript client's end-to-end tests need Node 20+; without ``node`` on PATH they are not collected,
and the run says so in one line (as ``make ts-test`` does)."""

from __future__ import annotations

import pytest

from tests.typescript.stack import NODE

NOT_RUN = "TypeScript end-to-end tests not run: node is not on PATH (clients/typescript needs Node 20 or newer)"

collect_ignore_glob = ["test_*.py"] if NODE is None else []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if NODE is None:
        terminalreporter.write_line(NOT_RUN)
