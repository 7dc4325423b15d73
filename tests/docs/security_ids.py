"""`make lint`: every test id docs/security.md names is collected by pytest and not skipped.

The threat model's rule (docs/security.md) is that each claim names the test that proves it, as a pytest id
``tests/PATH.py::test_name`` (optionally with a parameter, ``[id]``). This asks pytest itself: it collects
the files those ids name, with the project's conftest (markers included), and reports each id that no
collected test matches, or whose tests are all skipped by a ``skip`` / ``skipif`` mark. A test id whose test
was renamed, moved or deleted is then a lint failure, not a stale claim.

Run: ``python -m tests.docs.security_ids [DOC]`` (exit 0, or 1 with one line per problem).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security.md"
TEST_ID = re.compile(r"tests/[A-Za-z0-9_/]+\.py::[A-Za-z0-9_]+(?:\[[^\]\s`|]*\])?")
"""A pytest node id as the doc writes it: a test function (in a module, not a class) and an optional parameter."""


def named_ids(text: str) -> list[str]:
    """The test ids `text` names, in order of first appearance."""
    return list(dict.fromkeys(TEST_ID.findall(text)))


def problems(ids: Iterable[str], collected: Mapping[str, bool], files: Iterable[str] = ()) -> list[str]:
    """One line per id that is not collected, or whose collected tests are all skipped.

    Args:
        ids: the ids the doc names.
        collected: every collected node id -> True if it is skipped.
        files: test files that do not exist (named in ids).
    """
    missing_files = set(files)
    out: list[str] = []
    for test_id in ids:
        path = test_id.split("::", 1)[0]
        if path in missing_files:
            out.append(f"{test_id}: no such file")
            continue
        matches = [skipped for node, skipped in collected.items() if node == test_id or node.startswith(test_id + "[")]
        if not matches:
            out.append(f"{test_id}: not collected by pytest")
        elif all(matches):
            out.append(f"{test_id}: skipped")
    return out


class _Recorder:
    """A pytest plugin keeping every collected node id and whether a skip mark applies to it."""

    def __init__(self) -> None:
        self.collected: dict[str, bool] = {}

    def pytest_collection_modifyitems(self, config: Any, items: list[Any]) -> None:
        from _pytest.skipping import evaluate_skip_marks

        for item in items:
            self.collected[item.nodeid] = evaluate_skip_marks(item) is not None


def check(doc: Path = DOC) -> list[str]:
    """Collect what `doc` names (in this process) and return the problems (empty: every id holds)."""
    import pytest

    ids = named_ids(doc.read_text())
    if not ids:
        return [f"{doc}: names no test id"]
    files = sorted({i.split("::", 1)[0] for i in ids})
    absent = [f for f in files if not (ROOT / f).is_file()]
    present = [f for f in files if f not in absent]
    recorder = _Recorder()
    if present:
        args = ["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir", str(ROOT), *present]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):  # the listing of every collected test is not the lint's output
            code = pytest.main(args, plugins=[recorder])
        if code not in (0, 5):  # 5: nothing collected (reported per id below)
            return [f"pytest could not collect {' '.join(present)} (exit {code}):", out.getvalue()[-2000:]]
    return problems(ids, recorder.collected, absent)


def main(argv: list[str]) -> int:
    doc = Path(argv[0]) if argv else DOC
    found = check(doc)
    for line in found:
        print(f"{doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc}: {line}", file=sys.stderr)
    if not found:
        print(f"{doc.name}: every test id it names is collected and not skipped")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
