"""Loads every fixture module under tests/fixtures/ (one module per service or concern)."""

import pkgutil

import pytest

pytest.register_assert_rewrite("tests.fixtures", "tests.e2e")

import tests.fixtures  # noqa: E402

pytest_plugins = [f"tests.fixtures.{m.name}" for m in pkgutil.iter_modules(tests.fixtures.__path__)]
