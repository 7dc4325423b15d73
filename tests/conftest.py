"""Loads every fixture module under tests/fixtures/ (one module per service or concern)."""

import pkgutil
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests assert behaviour, never speed: no per-example deadline (a busy 2-core host or a parallel
# run stretched one KMS-parser example past Hypothesis' default 200 ms and failed it).
settings.register_profile("mrtr-keys", deadline=None)
settings.load_profile("mrtr-keys")

pytest.register_assert_rewrite("tests.fixtures", "tests.e2e")

import tests.fixtures  # noqa: E402

pytest_plugins = [f"tests.fixtures.{m.name}" for m in pkgutil.iter_modules(tests.fixtures.__path__)]


E2E_DIRS = frozenset({"e2e", "bench", "cli", "typescript"})
"""Directories that are end to end as a whole (real MCP flows, the benchmark, the CLI in subprocesses, the
TypeScript client against real processes)."""
E2E_FIXTURES = frozenset({"openbao", "openbao_tls", "moto_server", "sidecar_factory", "contract_sidecars", "cli"})
"""Fixtures that start a real service or run the CLI in a subprocess: a test using one is end to end."""
E2E_MODULES = frozenset(
    {
        "audit/test_cli.py",
        "audit/test_gates.py",
        "audit/test_process_writer.py",
        "audit/test_concurrent_start.py",
        "audit/test_verify_scale.py",
        "service/test_api.py",
        "service/test_reload.py",
        "service/test_clients_and_config.py",
        "keystores/test_file.py::test_a_writer_gives_up_on_a_held_lock_with_exit_75_and_changes_nothing",
    }
)
"""Modules (or single tests) that start processes without one of those fixtures."""
LONG_FIRST = (
    "e2e/test_fleet_rotation.py",
    "e2e/test_paused_instance.py",
    "typescript/test_e2e.py",
    "e2e/test_adopt_sdk.py",
    "docs/test_doc_commands.py",
    "e2e/test_fleet_controls.py",
    "bench/",
    "typescript/",
    "audit/test_concurrent_start.py",
    "deploy/",
    "cli/test_cli.py",
)
"""Paths (prefixes) of the longest tests, in the order they are started. Under ``pytest -n`` (`make test`)
the suite lasts at least as long as its longest test, which mostly waits on gates and processes: started
first, it waits while the other workers run everything else."""
E2E_PARAMS = ("sidecar", "kms", "vault", "aws")
"""Prefixes of parameters naming a codec or keystore whose backend is a real service (sidecar, sidecar-sdk,
kms, vault-remote, vault-datakey, vault-kv, aws-sm: fixtures fetched by name at run time)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark end-to-end tests ``e2e`` (see the sets above): ``pytest -m "not e2e"`` is the fast loop; then
    move the `LONG_FIRST` tests to the front (a stable sort: the rest keep their order)."""
    root = Path(__file__).parent

    def rank(item: pytest.Item) -> int:
        name = item.path.relative_to(root).as_posix()
        return next((i for i, prefix in enumerate(LONG_FIRST) if name.startswith(prefix)), len(LONG_FIRST))

    items.sort(key=rank)
    for item in items:
        rel = item.path.relative_to(root)
        name = rel.as_posix()
        if (
            rel.parts[0] in E2E_DIRS
            or name in E2E_MODULES
            or f"{name}::{item.originalname}" in E2E_MODULES  # type: ignore[attr-defined]
            or E2E_FIXTURES.intersection(getattr(item, "fixturenames", ()))
            or _service_param(item)
        ):
            item.add_marker(pytest.mark.e2e)


def _service_param(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    values = callspec.params.values() if callspec is not None else ()
    return any(isinstance(v, str) and v.startswith(E2E_PARAMS) for v in values)
