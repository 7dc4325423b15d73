"""Rendering for the CLI: rich tables for people, JSON for machines. No secrets pass through here."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any


def plain(value: object) -> str:
    """`value` as text that cannot drive a terminal: every character that is not printable (a newline, a tab,
    ESC, NUL) shown escaped as Python writes it (``\\n``, ``\\x1b``). Stored values reach tables and lines:
    an audience a sidecar client sent, a name in a store whoever writes it chose."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def print_json(data: Any) -> None:
    """Write `data` as one JSON document to stdout."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def stream_json_array(items: Iterable[Any]) -> int:
    """Write `items` as one JSON array to stdout, item by item (the same text `print_json` writes
    for the list, without holding it); returns how many were written."""
    n = 0
    for item in items:
        text = json.dumps(item, indent=2, sort_keys=False, default=str).replace("\n", "\n  ")
        sys.stdout.write(("[\n  " if n == 0 else ",\n  ") + text)
        n += 1
    sys.stdout.write("\n]\n" if n else "[]\n")
    return n


def print_line(text: str) -> None:
    """Write one plain line to stdout."""
    sys.stdout.write(text + "\n")


def print_change(result: Any, json_: bool, *, with_forced: bool = False) -> None:
    """A saved (or skipped) key ring change (`ring.apply.ChangeResult`): its message, or with `json_` the
    object ``{step, changed, [forced,] generation, message, **details}`` (``forced`` for rotation steps)."""
    if not json_:
        print_line(result.message)
        return
    doc: dict[str, Any] = {"step": result.op, "changed": result.changed}
    if with_forced:
        doc["forced"] = result.forced
    print_json({**doc, "generation": result.ring.generation, "message": result.message, **result.details})


def print_table(
    title: str | None,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    compact: bool = False,
    tight: bool = False,
) -> None:
    """A rich table on stdout (plain text when stdout is not a terminal).

    Cells are plain text: never read as rich markup or ``:emoji:`` codes (an instance id
    ``host:100:...`` stays as written, and a ``[/x]`` in a stored value cannot break the table), with control
    characters escaped (`plain`: an ESC or a newline in a stored value cannot move the cursor or add a row).

    `compact`: no vertical rules and one space of padding, for tables whose columns were chosen to
    fit an 80-column terminal (the ``--wide`` variants print every column with rules); `tight`: two spaces
    between columns instead of three.
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    if compact:
        table = Table(
            title=title,
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            padding=(0, 1),
            collapse_padding=tight,
            title_justify="left",
        )
    else:
        table = Table(title=title, show_lines=False)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(Text("" if v is None else plain(v)) for v in row))
    console = Console(soft_wrap=True)
    if not console.is_terminal:  # piped: never cut columns to a guessed 80; let the table be as wide as it is
        console = Console(soft_wrap=True, width=max(console.width, 400))
        table.expand = False
    console.print(table)


def short_time(value: str | None) -> str:
    """``2026-12-01T15:01:36.123456Z`` -> ``2026-12-01 15:01`` (UTC, to the minute) for narrow tables."""
    if not value:
        return "-"
    return value[:16].replace("T", " ")


def print_fields(title: str | None, fields: dict[str, Any]) -> None:
    """A two-column table of name/value pairs."""
    print_table(title, ["field", "value"], [(k, v) for k, v in fields.items()])


def error(text: str) -> None:
    """One line on stderr, prefixed with the program name (inner newlines and tabs folded; other control
    characters, such as an ESC inside a path the user typed, shown escaped so they cannot drive the terminal)."""
    sys.stderr.write(f"mrtr-keys: {plain(' '.join(text.split()))}\n")


def json_requested(argv: Sequence[str]) -> bool:
    """True if the command line asked for ``--json`` (errors are then also a JSON object on stdout)."""
    return "--json" in argv


def print_json_error(message: str, exit_code: int, **extra: Any) -> None:
    """``{"error": ..., "exit_code": ...}`` on stdout, so a pipeline parsing --json always gets JSON."""
    print_json({"error": " ".join(message.split()), "exit_code": exit_code, **extra})
