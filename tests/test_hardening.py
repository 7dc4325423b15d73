"""`mrtr_keys.harden_process` without changing this process (issue 39, item 5): what it says where it cannot or
must not harden, and what a key-holding child is told. That it works, against another process of the same
user, is tests/e2e/test_process_hardening.py (a hardened test worker would pass its limits to every process
it starts after)."""

from __future__ import annotations

import sys

import pytest

import mrtr_keys
from mrtr_keys import hardening
from mrtr_keys.hardening import CHILD_FLAG, Hardening, allow_core_dumps_from_env, child_args


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hardening, "_allowed", None)
    monkeypatch.delenv("MRTR_KEYS_ALLOW_CORE_DUMPS", raising=False)


def test_allowed_core_dumps_leave_the_process_as_it_is_and_say_why() -> None:
    result = mrtr_keys.harden_process(allow_core_dumps=True)
    assert result == Hardening(
        False,
        "core dumps allowed (--allow-core-dumps): other processes of this user can attach to this process and "
        "read its keys, and a crash can write them to a core file",
    )
    assert child_args() == [CHILD_FLAG]  # and a key-holding child is told so


def test_on_another_system_it_is_a_one_line_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert mrtr_keys.harden_process() == Hardening(
        False, "process hardening (non-dumpable, no core file) is Linux only; not on darwin"
    )
    assert child_args() == []  # the child still hardens itself where it can


@pytest.mark.parametrize(("value", "allowed"), [("1", True), ("TRUE", True), ("yes", True), ("0", False), ("", False)])
def test_the_environment_variable(value: str, allowed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MRTR_KEYS_ALLOW_CORE_DUMPS", value)
    assert allow_core_dumps_from_env() is allowed
    assert child_args() == ([CHILD_FLAG] if allowed else [])
