"""The check `make lint` runs over docs/security.md (`tests.docs.security_ids`): which ids it reads from the page,
and what it reports for an id that is not collected, skipped, or in a file that does not exist."""

from __future__ import annotations

from tests.docs.security_ids import named_ids, problems

PAGE = """
| can | stops | `tests/a/test_x.py::test_one`, `tests/a/test_x.py::test_two[p-1]` | none |
| again | `tests/a/test_x.py::test_one` | a placeholder such as `tests/<path>.py::<test name>` is no id |
"""


def test_the_ids_are_read_from_the_tables_once_each_with_their_parameter() -> None:
    assert named_ids(PAGE) == ["tests/a/test_x.py::test_one", "tests/a/test_x.py::test_two[p-1]"]


def test_an_id_is_matched_by_its_parametrized_tests_and_reported_when_missing_or_skipped() -> None:
    collected = {
        "tests/a/test_x.py::test_one[a]": False,
        "tests/a/test_x.py::test_one[b]": True,  # one parameter skipped: the id still has a test that runs
        "tests/a/test_x.py::test_skipped": True,
        "tests/a/test_x.py::test_one_more": False,  # a longer name is not a parameter of test_one
    }
    ids = ["tests/a/test_x.py::test_one", "tests/a/test_x.py::test_skipped", "tests/a/test_x.py::test_gone"]
    assert problems(ids, collected) == [
        "tests/a/test_x.py::test_skipped: skipped",
        "tests/a/test_x.py::test_gone: not collected by pytest",
    ]
    assert problems(["tests/b/test_y.py::test_z"], {}, ["tests/b/test_y.py"]) == [
        "tests/b/test_y.py::test_z: no such file"
    ]
