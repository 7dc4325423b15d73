"""`mrtr-keys audit verify`: walk every chain in bounded pages (`mrtr_keys.audit.verifying.verify_stream`).

From genesis, or from each chain's prune cut (``audit prune``), or with ``--since`` from a checkpoint
forward. Progress goes to stderr on runs longer than a few seconds; ``--json`` prints a summary.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from mrtr_keys.audit.events import plural
from mrtr_keys.cli.audit_cmd import _chain_keys, _open, _trusted_records
from mrtr_keys.cli.audit_options import AuditOpt, SourcesOpt
from mrtr_keys.cli.options import JsonOpt, KeystoreOpt
from mrtr_keys.errors import AuditUnavailable, ConfigError

PROGRESS_AFTER = 2.0
"""Seconds of verifying before progress lines start (short runs print none)."""
UNLISTED_SHOWN = 20
"""Files named in the warning about files no manifest lists (``--json`` names them all)."""
QUIET_EVERY = 10.0
"""Seconds between progress lines when stderr is not a terminal (a terminal's line is redrawn)."""


class _Progress:
    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()
        self._last = 0.0
        self._shown = False

    def __call__(self, records: int, elapsed: float) -> None:
        if elapsed < PROGRESS_AFTER or (not self._tty and elapsed - self._last < QUIET_EVERY):
            return
        self._last = elapsed
        done = plural(records, "record", grouped=True)
        line = f"mrtr-keys: verifying: {done} in {elapsed:.0f} s ({records / elapsed:,.0f}/s)"
        sys.stderr.write(f"\r{line}\x1b[K" if self._tty else line + "\n")
        sys.stderr.flush()
        self._shown = True

    def done(self) -> None:
        if self._shown and self._tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def verify(
    keystore_: KeystoreOpt = None,
    audit: AuditOpt = None,
    checkpoints: SourcesOpt = None,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help="Start from a checkpoint instead of genesis: `last`, a checkpoint's time, or a time "
            "(1d, ISO 8601; the newest checkpoint written at or before it). Its heads are trusted.",
        ),
    ] = None,
    from_archive: Annotated[
        list[str] | None,
        typer.Option(
            "--from-archive",
            help="Verify the archive (directory or s3://BUCKET/PREFIX, `audit archive`) and the live store "
            "as one history: manifests, segments, and the link to the store's prune checkpoint. Repeat it "
            "for an archive that moved between locations.",
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Walk every writer's chain, keyed links checked with the chain key (and the checkpoints and anchors);
    exit 1 at the first break, 75 when the store, an archive or a checkpoint location cannot be read now or
    a prune ran meanwhile (run it again), 2 for a bad option or without the chain key.

    Reads the store in bounded pages (memory does not grow with the log). After `audit prune`, each
    chain starts from the prune's recorded cut."""
    from mrtr_keys.audit.events import parse_when
    from mrtr_keys.audit.verifying.store_match import by_url_note, checkpoints_of, id_break
    from mrtr_keys.audit.verifying.trust import verify_store
    from mrtr_keys.audit.verifying.verify_stream import StreamReport
    from mrtr_keys.cli.output import error, print_json, print_line

    if from_archive and since is not None:
        raise ConfigError(
            "--from-archive and --since cannot be combined (--from-archive starts at the archive's start)"
        )
    dests = [_archive_location(where) for where in from_archive or ()]
    keys = _chain_keys(keystore_, "audit verify")
    store = _open(audit, keystore_)
    try:
        docs, files = _trusted_records(checkpoints, keystore_)
    except BaseException:
        store.close()
        raise
    matched = checkpoints_of(docs, store)
    note = by_url_note(matched, store)
    if note is not None:
        error(note)
    start = None if since is None else "last" if since.strip() == "last" else parse_when(since)
    progress = _Progress()
    report: StreamReport
    try:
        if dests:
            from mrtr_keys.audit.verifying.archive_verify import verify_archive

            report = verify_archive(dests, store, docs, progress=progress, keys=keys)
        else:
            report = verify_store(store, docs, since=start, progress=progress, keys=keys)
    finally:
        progress.done()
        store.close()
    unlisted = getattr(report, "unlisted", None)
    if dests and unlisted:
        shown = ", ".join(n if n.isprintable() else repr(n) for n in unlisted[:UNLISTED_SHOWN]) + (
            f" (and {len(unlisted) - UNLISTED_SHOWN} more)" if len(unlisted) > UNLISTED_SHOWN else ""
        )
        where = dests[0].uri if len(dests) == 1 else "the archive locations"
        sys.stderr.write(
            f"mrtr-keys: warning: {plural(len(unlisted), 'file')} in {where} listed by no manifest, not "
            f"verified (an interrupted audit archive run leaves such files; remove them when no run is going): "
            f"{shown}\n"
        )
    replaced = id_break(store, matched, report.writers)
    if not report.ok and replaced is None and any(_pruned_meanwhile(f, store, docs) for f in files):
        raise AuditUnavailable(
            f"audit verify: a prune or archive of {', '.join(map(str, files))} ran while verify read the store, so "
            f"what it found ({report.first.kind if report.first else 'a break'}) may be that prune's doing: run "
            "verify again when it has finished"
        )
    if json_:
        out = report.to_json()
        out.update(matched.to_json(getattr(store, "store_id", None)))
        if replaced is not None:
            out["ok"] = False
            out["store_replaced"] = replaced
        print_json(out)
    elif replaced is not None:
        print_line(f"BROKEN: store id: {replaced}")
    else:
        _print_report(report, dests)
    if not report.ok or replaced is not None:
        raise typer.Exit(1)


def _archive_location(where: str) -> Any:
    from mrtr_keys.audit.retention.archive_dest import open_destination

    dest = open_destination(where)
    root = getattr(dest, "root", None)  # a directory (an s3:// location has no such test)
    if root is not None and not root.is_dir():
        raise ConfigError(f"--from-archive {where}: no such directory")
    return dest


def _print_report(report: Any, dests: list[Any]) -> None:
    from mrtr_keys.cli.output import print_line

    first = report.first
    origin = f" from the checkpoint of {report.since}" if report.since else ""
    if report.pruned_before:
        origin += f" (pruned before {report.pruned_before})"
    if dests:
        summary = report.to_json()["archive"]
        origin += (
            f", {summary['records']} of them from {plural(summary['segments'], 'archived segment')} in "
            f"{plural(summary['manifests'], 'manifest')} at {summary['location']}"
        )
    if first is None:
        print_line(
            f"ok: {plural(report.records, 'record')} in {plural(report.chains, 'chain')} verified{origin} "
            f"({_keyed(report)}); {plural(report.checkpoints_checked, 'checkpointed head')} present"
        )
        return
    where = f"position {first.position}" if first.position else "end of chain"
    if first.kind in ("archive", "store", "checkpoint"):
        print_line(f"BROKEN: {first.kind}: {first.detail}")
    else:
        print_line(
            f"BROKEN: {first.kind} record at {where} (writer {first.writer}, seq {first.seq}, "
            f"time {first.time}): {first.detail}"
        )
    for b in report.breaks:
        if b is not first:
            print_line(f"  also: {b.kind} in writer {b.writer} at seq {b.seq}: {b.detail}")


def _keyed(report: Any) -> str:
    """How many records were verified with keyed links and how many with unkeyed ones (before the switch)."""
    text = f"{report.keyed:,} keyed, {report.unkeyed:,} unkeyed"
    switch = report.switch
    if report.unkeyed and switch is not None:
        text += f": written before the switch to keyed links at position {switch['position']} ({switch['time']})"
    elif report.unkeyed:
        text += ": written before keyed links"
    return text


def _pruned_meanwhile(path: Path, store: Any, seen: list[dict[str, Any]]) -> bool:
    """Whether a prune or archive of the checkpoint file `path` holds its lock now, or recorded a cut of
    `store` that verify did not read (`seen`: the records it read)."""
    from mrtr_keys.audit.retention.prune import pruner_running
    from mrtr_keys.audit.verifying.ledger import PRUNE, FileLedger
    from mrtr_keys.audit.verifying.store_match import checkpoints_of

    if pruner_running(path):
        return True
    return any(d.get("kind") == PRUNE and d not in seen for d in checkpoints_of(FileLedger(path).read(), store).docs)
