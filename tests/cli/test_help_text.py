"""`--help` reads cleanly: what Typer shows of option help and docstrings is plain text (no RST ``double
backticks``), says a default as what it is, and says an option is required once (Typer's "[required]")."""

from __future__ import annotations

import re

import pytest

from mrtr_keys.audit.writing.stores.base import SCHEMA_VERSION
from tests.fixtures.audit import cli

COMMANDS = [
    ("audit", "prune"),
    ("audit", "checkpoint"),
    ("audit", "archive"),
    ("audit", "verify"),
    ("audit", "query"),
    ("fleet", "status"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_reads_cleanly(command: tuple[str, ...]) -> None:
    res = cli(*command, "--help")
    text = re.sub(r"[│╭╮╰╯─\s]+", " ", res.out)  # rich's boxes and wrapping
    assert res.code == 0, res.err
    assert "``" not in text, text
    assert "(required)" not in text and "[required] [required]" not in text, text  # Typer says it once
    assert "the checkpoint default" not in text, text


def test_the_checkpoint_file_is_checkpoints_in_prune_archive_and_checkpoint() -> None:
    for command in ("prune", "checkpoint", "archive"):
        text = cli("audit", command, "--help").out
        assert "--checkpoints" in text, (command, text)
    assert "--to" not in cli("audit", "prune", "--help").out  # the old name is hidden
    verify = re.sub(r"[│\s]+", " ", cli("audit", "verify", "--help").out)
    assert "[default: $MRTR_KEYS_AUDIT_CHECKPOINTS, else audit" in verify, verify


def test_verify_help_names_the_exit_codes_cron_tells_apart() -> None:
    text = re.sub(r"\s+", " ", cli("audit", "verify", "--help").out)
    assert (
        "exit 1 at the first break, 75 when the store, an archive or a checkpoint location cannot be read now" in text
    )
    assert "2 for a bad option or without the chain key" in text, text


def test_migrate_help_names_the_schema_it_migrates_to() -> None:
    text = re.sub(r"[│\s]+", " ", cli("audit", "migrate", "--help").out)
    assert f"from schema 3 or 4 to {SCHEMA_VERSION}" in text, text  # it said "to schema 4" after 5 landed
    assert "schema 4 (" not in text, text
