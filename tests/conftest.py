"""Loads every fixture module under tests/fixtures/ (one module per service or concern)."""

import atexit
import gc
import os
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
        "keystores/test_file.py::test_a_failed_write_leaves_the_old_ring_as_it_was",
        "keystores/test_mounted.py::test_a_write_is_refused_naming_where_writes_go",
        "backends/test_missing_extras.py",
        "fleet/test_gates.py::test_promote_refuses_while_a_live_instance_lacks_phase_1_then_allows",
        "fleet/test_gates.py::test_retire_refuses_while_the_old_kid_seals_within_ttl",
        "fleet/test_presence.py::test_a_clean_shutdown_writes_stopped",
        "test_support.py::test_a_server_whose_port_was_taken_is_started_again_on_another",
    }
)
"""Modules (or single tests) that start processes without one of those fixtures: the CLI in its own process
(`run_cli`), a fresh interpreter, a server. The audit writer child that a library codec starts is part of the
product's in-process sink: tests of it stay in the fast loop."""
LONG_FIRST = (
    ("e2e/test_fleet_rotation.py", 210),
    ("typescript/test_e2e.py", 150),
    ("e2e/test_paused_instance.py::test_instances_paused_across_a_promote_and_a_retire_reject_nothing[aws-sm]", 115),
    ("e2e/test_paused_instance.py::test_instances_paused_across_a_promote_and_a_retire_reject_nothing[vault-kv]", 105),
    ("e2e/test_paused_instance.py::test_an_instance_cut_from_keystore_and_audit_store_for_40_s_rejects", 120),
    ("e2e/test_paused_instance.py", 40),
    ("e2e/test_fleet_controls.py", 80),
    ("e2e/test_revoke_fleet.py::test_a_revoked_primary_dies_on_every_instance_within_3_s_under_traffic[vault-kv]", 75),
    ("docs/test_doc_commands.py", 70),
    ("bench/test_chaos.py", 75),
    ("bench/test_bench_fleet.py", 70),  # before "bench/": the first prefix that matches names the unit
    ("bench/", 70),
    ("e2e/test_gray_replay.py::test_a_silent_store_delays_only_the_unseals_that_need_it", 60),
    ("e2e/test_adopt_sdk.py", 58),
    ("e2e/test_kms_rotation.py", 55),
    ("e2e/test_kek_kms.py", 45),
    ("e2e/test_revoke_fleet.py", 30),
    ("keystores/test_concurrency.py", 50),
    ("e2e/test_gray_replay.py::test_a_library_unseal_fails_closed_within_the_deadline_while_the_store_is_silent", 48),
    ("e2e/test_vault_rotation.py", 47),
    ("e2e/test_keystore_fleet.py", 47),
    ("e2e/test_kek_vault.py", 35),
    ("typescript/test_docs.py", 45),
    ("cli/test_cli.py", 45),
    ("deploy/", 40),
    ("e2e/test_audit_memory.py", 40),
    ("e2e/test_audit_flaps.py::test_forty_flaps", 32),
    ("e2e/test_audit_flaps.py::test_a_sidecar_whose_audit_store_flaps", 32),
    ("e2e/test_revoke_cut_off.py", 25),
    ("audit/test_concurrent_start.py", 24),
    ("e2e/test_usage_fleet.py", 30),
    ("e2e/test_usage_budget.py", 20),
    # the fast loop's longest (pytest -m "not e2e"): started first, so none of them is left running alone at the end
    ("service/test_fence_sidecar.py::test_a_sidecar_that_missed_a_promote_opens_the_new_key_after_one_look", 5),
    ("replay/test_stores.py::test_a_postgres_connect_that_timed_out_leaves_no_socket_open", 4),
    ("audit/test_shipping.py::test_a_killed_writer_loses_nothing_silently", 4),
    ("service/test_parity.py::test_fast_path_and_fastapi_route_answer_alike", 3),
    ("audit/test_sink.py::test_full_queue_counts_drops_logs_and_never_blocks_a_seal", 2),
    ("test_support.py::test_the_proxy_blackholes_delays_throttles_resets_after_a_marker_and_flaps", 3),
)
"""``path`` or ``path::test`` prefixes of the longest tests (one unit each, kept together: a module-scoped
fixture is started once) and their rough wall time in seconds on a loaded 2-core host, longest first. The
suite lasts at least as long as its longest test, which mostly waits on gates and processes, so these start
first; under ``pytest -n N`` (`make test`) each goes to the head of a different worker's first batch
(`_spread`)."""
E2E_PARAMS = ("sidecar", "kms", "vault", "aws")
"""Prefixes of parameters naming a codec or keystore whose backend is a real service (sidecar, sidecar-sdk,
kms, vault-remote, vault-datakey, vault-kv, aws-sm: fixtures fetched by name at run time)."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """In the fast loop (``-m "not e2e"``), the directories that are end to end as a whole are not even
    imported: every worker would pay for importing and collecting tests it then deselects."""
    if config.getoption("markexpr", "") == "not e2e" and collection_path.parent == Path(__file__).parent:
        return True if collection_path.name in E2E_DIRS else None
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark end-to-end tests ``e2e`` (see the sets above), before ``-m`` selects: ``pytest -m "not e2e"``
    is the fast loop."""
    root = Path(__file__).parent
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


def _unit(item: pytest.Item, root: Path) -> int:
    name = f"{item.path.relative_to(root).as_posix()}::{item.name}"
    return next((i for i, (prefix, _) in enumerate(LONG_FIRST) if name.startswith(prefix)), len(LONG_FIRST))


def _spread(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """`items` ordered for ``--dist worksteal`` over `workers` workers, which first hands each worker one
    contiguous batch (``len(pending) // workers_left`` tests) and later lets an idle worker steal the tail
    of the longest queue: the `LONG_FIRST` units are dealt to the batches longest first, each to the batch
    with the least estimated time so far, at its head; the other tests fill the batches in their order."""
    root = Path(__file__).parent
    units: dict[int, list[pytest.Item]] = {}
    rest: list[pytest.Item] = []
    for item in items:
        u = _unit(item, root)
        (rest if u == len(LONG_FIRST) else units.setdefault(u, [])).append(item)
    lanes: list[list[pytest.Item]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for u in sorted(units, key=lambda u: -LONG_FIRST[u][1]):
        lane = min(range(workers), key=lambda i: load[i])
        lanes[lane].extend(units[u])
        load[lane] += LONG_FIRST[u][1]
    ordered: list[pytest.Item] = []
    left = len(items)
    fill = iter(rest)
    for i, lane in enumerate(lanes):
        size = left // (workers - i)
        ordered.extend(lane)
        ordered.extend(item for _, item in zip(range(size - len(lane)), fill, strict=False))
        left -= size
    ordered.extend(fill)
    return ordered


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> object:
    """Collection without the cyclic garbage collector, then everything alive (imported modules, the
    collected tests) frozen out of its reach: every worker builds about a million objects importing and
    collecting, which the collector otherwise walks again in each full collection while the tests run
    (about 1.5 s of CPU a worker). Objects the tests make are collected as before."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.enable()
        gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """After ``-m`` and ``-k`` have selected, before a worker reports its collection: the `LONG_FIRST` units
    first (one process), or spread over the workers' first batches (``pytest -n N``; every worker collects
    and orders alike, as xdist requires)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    session.items[:] = _spread(session.items, workers)


def _service_param(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    values = callspec.params.values() if callspec is not None else ()
    return any(isinstance(v, str) and v.startswith(E2E_PARAMS) for v in values)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """An xdist worker, done (its results are with the controller by now), leaves without tearing down
    every imported module (`tests.support.zygote.leave`): that took 0.5 to 1.5 s of CPU per worker, paid by
    every run and, for the last worker, on the suite's wall clock."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        atexit.register(_leave_at_once)


def _leave_at_once() -> None:
    # registered last, so the interpreter calls it first: every other handler runs once, inside `leave`
    from tests.support.zygote import leave

    atexit.unregister(_leave_at_once)
    leave(0)
