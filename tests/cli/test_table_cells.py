"""Table cells are shown as stored: rich must not read an instance id ``host:100:...`` as the ``:100:``
emoji, nor a ``[/x]`` in a stored value as markup (which broke the table with an internal error)."""

from __future__ import annotations

from pathlib import Path

from bench.audit_log import fill

from mrtr_keys.cli.output import print_table
from tests.fixtures.audit import cli


def test_checkpoint_table_shows_a_writer_with_pid_100_as_written(tmp_path: Path, audit_key: bytes) -> None:
    url = f"sqlite://{tmp_path}/audit.db"
    fill(url, 300, tx=100)  # chains bench-host:100:..., :101:, :102:
    res = cli("audit", "checkpoint", "--audit", url, "--checkpoints", str(tmp_path / "cps.jsonl"))
    assert res.code == 0, res.err
    assert "bench-host:100:20260101T000000.000000Z#1/p0" in res.out and "\N{HUNDRED POINTS SYMBOL}" not in res.out


def test_a_cell_that_looks_like_markup_is_printed_as_text(capsys: object) -> None:
    print_table(None, ["client"], [["a[/b]"], ["[bold]x"]])
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "a[/b]" in out and "[bold]x" in out
