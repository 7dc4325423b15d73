"""The package's layers import only downward, and nothing inside imports the package root.

The rule and the layers are docs/architecture.md's (issue 25): a module imports only from its own layer
or below; `mrtr_keys/__init__.py` is for users. Read from the source with `ast` (every import, at module
level, inside functions and under TYPE_CHECKING alike), so a lazy import cannot hide an upward edge.
`make lint` runs this file.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "mrtr_keys"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "version", "urls", "token", "deadlines", "hardening", "files"),
    ("logs", "tracing"),
    ("ring",),
    ("providers",),
    ("keystores",),
    ("codecs",),
    ("backends", "inspection"),
    ("changes",),
    ("audit",),
    ("fleet",),
    ("replay",),
    ("factory",),
    ("service",),
    ("cli", "run", "example"),
)
"""Bottom to top; the names of one tuple are one layer (they may import each other)."""

RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def unit_of(module: str) -> str:
    """The top-level unit (package or module under `mrtr_keys`) a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """(line, imported module, imported names) of every import in one file."""
    try:
        return _imports_in(path.read_text())
    except SyntaxError as exc:
        exc.filename = str(path)  # parsed by text (cached), so name the file the error is in
        raise


@functools.cache
def _imports_in(text: str) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    # by text: the controls below check copies of the same files, and parsing is most of the check's time
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, ()) for a in node.names)
    return tuple(i for i in found if i[1] == "mrtr_keys" or i[1].startswith("mrtr_keys."))


def module_name(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def violations(src: Path = SRC) -> list[str]:
    """Every upward import and every import of the package root, as ``file:line: text`` lines."""
    found = []
    for path in sorted(src.rglob("*.py")):
        here = module_name(path, src)
        if here == "mrtr_keys":
            continue  # the root re-exports for users
        mine = unit_of(here)
        for line, target, _names in imports(path):
            where = f"{path.relative_to(src.parent)}:{line}"
            if target == "mrtr_keys":
                found.append(f"{where}: imports the package root (import the module that defines the name)")
                continue
            theirs = unit_of(target)
            if theirs not in RANK or mine not in RANK:
                found.append(f"{where}: {theirs or mine!r} is in no layer (add it to docs/architecture.md and LAYERS)")
            elif RANK[theirs] > RANK[mine]:
                found.append(f"{where}: {mine} (layer {RANK[mine]}) imports {target} (layer {RANK[theirs]}): upward")
    return found


def test_every_import_points_down_the_layers_and_none_names_the_package_root() -> None:
    assert violations() == []


def test_every_unit_of_the_package_is_in_one_layer() -> None:
    units = {p.stem if p.is_file() else p.name for p in SRC.iterdir() if p.name not in {"__init__.py", "__pycache__"}}
    units -= {"py"}  # a py.typed marker, if any
    assert units - set(RANK) == set()
    assert set(RANK) - units == set()


def test_the_layers_table_is_the_one_docs_architecture_shows() -> None:
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    for layer in LAYERS:
        assert all(f"`{name}" in text for name in layer), layer


@pytest.mark.parametrize(
    ("where", "text", "why"),
    [
        ("ring/extra.py", "from mrtr_keys.keystores import Keystore\n", "upward"),
        ("codecs/extra.py", "def f():\n    from mrtr_keys.service import app\n", "upward"),
        ("audit/extra.py", "import mrtr_keys\n", "package root"),
        ("fleet/extra.py", "from mrtr_keys import factory\n", "package root"),
    ],
)
def test_a_deliberately_upward_import_is_caught(tmp_path: Path, where: str, text: str, why: str) -> None:
    """A control: the check fails on an upward import (lazy ones too) and on an import of the root."""
    copy = tmp_path / "mrtr_keys"
    for path in SRC.rglob("*.py"):
        target = copy / path.relative_to(SRC)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    (copy / where).write_text(text)
    found = violations(copy)
    assert len(found) == 1 and why in found[0] and where in found[0]


def test_the_version_is_the_one_pyproject_declares() -> None:
    import tomllib

    from mrtr_keys.version import __version__

    project = tomllib.loads((SRC.parents[1] / "pyproject.toml").read_text())["project"]
    assert __version__ == project["version"]


MAX_MODULE_LINES = 450
"""docs/architecture.md's 'about 400 lines at most', with the slack 'about' gives; a module past it is split by
concept (as providers/vault/ was: client, settings, login, errors)."""


def test_no_module_is_past_the_size_a_module_may_have() -> None:
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_the_vault_client_module_still_offers_every_name_it_did_before_the_split() -> None:
    from mrtr_keys.providers.vault import client, errors, login, settings

    assert client.VaultSettings is settings.VaultSettings
    assert client.VaultRefused is errors.VaultRefused and client.LoginRefused is errors.LoginRefused
    assert client.DEFAULT_K8S_TOKEN_FILE == settings.DEFAULT_K8S_TOKEN_FILE
    assert callable(client.latest_version) and callable(login.read_jwt)
