"""Loads every fixture module under tests/fixtures/ (one module per service or concern)."""

import pkgutil

import tests.fixtures

pytest_plugins = [f"tests.fixtures.{m.name}" for m in pkgutil.iter_modules(tests.fixtures.__path__)]
