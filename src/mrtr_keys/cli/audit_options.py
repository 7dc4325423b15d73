"""The checkpoint-file option shared by `audit prune`, `audit archive` and `audit checkpoint`, and the
progress lines of the long ones.

Its name is ``--checkpoints`` everywhere (``audit archive --to`` is the archive location). ``audit prune``
and ``audit checkpoint`` called it ``--to`` before; that spelling still works, hidden from ``--help``,
with a one-line note on stderr. And the audit store option, ``--audit``, of the root and of the subcommands.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

RootAuditOpt = Annotated[
    str | None,
    typer.Option(
        "--audit",
        envvar="MRTR_KEYS_AUDIT",
        help="Audit store: sqlite:///PATH, postgresql://..., jsonl:///PATH or off "
        "[default: audit.db in the state directory].",
        show_default=False,
    ),
]
AuditOpt = Annotated[
    str | None,
    typer.Option(
        "--audit",
        help="Audit store: sqlite:///PATH, postgresql://..., jsonl:///PATH or off [default: the root --audit, "
        "else $MRTR_KEYS_AUDIT, else audit.db in the state directory].",
        show_default=False,
    ),
]
"""A subcommand's ``--audit``: no environment variable of its own, so ``mrtr-keys --audit URL audit verify`` is
not overridden by ``MRTR_KEYS_AUDIT`` (the root option reads it; `_open` falls back to the root's value)."""

CheckpointsOpt = Annotated[
    Path | None,
    typer.Option(
        "--checkpoints",
        envvar="MRTR_KEYS_AUDIT_CHECKPOINTS",
        help="Checkpoint file: earlier checkpoints and cuts are read from it and this run's are appended "
        "(a place the store's writers cannot rewrite) "
        "[default: $MRTR_KEYS_AUDIT_CHECKPOINTS, else audit-checkpoints.jsonl in the state directory].",
        show_default=False,
    ),
]

LedgerOpt = Annotated[
    str | None,
    typer.Option(
        "--checkpoints",
        envvar="MRTR_KEYS_AUDIT_CHECKPOINTS",
        help="Where checkpoints are kept: a file, a directory or s3://BUCKET/PREFIX (object-locked); earlier ones "
        "are read from it and this one is added (a place the store's writers cannot rewrite) "
        "[default: $MRTR_KEYS_AUDIT_CHECKPOINTS, else audit-checkpoints.jsonl in the state directory].",
        show_default=False,
    ),
]
SourcesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--checkpoints",
        help="Trusted records to check the store against: a checkpoint file (checkpoints, prune cuts), or a file, "
        "directory or s3://BUCKET/PREFIX of anchors (serve --audit-anchor); repeat for several "
        "[default: $MRTR_KEYS_AUDIT_CHECKPOINTS, else audit-checkpoints.jsonl in the state directory; and "
        "$MRTR_KEYS_AUDIT_ANCHOR if set].",
        show_default=False,
    ),
]

OldToOpt = Annotated[Path | None, typer.Option("--to", hidden=True, help="Old name of --checkpoints (still accepted).")]


def checkpoints_option(command: str, checkpoints: str | Path | None, old_to: Path | None) -> str | Path | None:
    """The checkpoint file given: ``--to`` (the old name, which wins as an explicit flag over the
    environment) or ``--checkpoints``; None for the default."""
    if old_to is None:
        return checkpoints
    from mrtr_keys.cli.output import error

    error(f"note: audit {command} --to is now --checkpoints (--to still works)")
    return old_to


def progress_lines(command: str) -> Callable[[str, int, float], None]:
    """A ``progress(phase, records, elapsed_seconds)`` callback for `command` (``prune``, ``archive``):
    silent for the first 2 s, then one stderr line at most every 10 s."""
    from mrtr_keys.audit.events import plural

    last = [0.0]

    def progress(phase: str, records: int, elapsed: float) -> None:
        if elapsed >= 2.0 and elapsed - last[0] >= 10.0:
            last[0] = elapsed
            sys.stderr.write(
                f"mrtr-keys: {command}: {phase} {plural(records, 'record', grouped=True)} in {elapsed:.0f} s\n"
            )
            sys.stderr.flush()

    return progress
