"""`mrtr-keys audit archive --before 30d --to DIR|s3://BUCKET/PREFIX`: segments + manifest, then prune
(`mrtr_keys.audit.retention.archive`)."""

from __future__ import annotations

from typing import Annotated

import typer

from mrtr_keys.audit.events import plural
from mrtr_keys.cli.audit_cmd import _chain_keys, _default_checkpoints, _open
from mrtr_keys.cli.audit_options import AuditOpt, CheckpointsOpt, progress_lines
from mrtr_keys.cli.audit_prune_cmd import _refuse_inside_gate_window, locked_docs
from mrtr_keys.cli.options import JsonOpt, KeystoreOpt


def archive(
    before: Annotated[
        str, typer.Option("--before", help="Archive then delete events older than this: 30d, 12w, or ISO 8601.")
    ],
    to: Annotated[
        str, typer.Option("--to", help="Where the segments and manifest go: a directory or s3://BUCKET/PREFIX.")
    ],
    keystore_: KeystoreOpt = None,
    audit: AuditOpt = None,
    checkpoints: CheckpointsOpt = None,
    retain_days: Annotated[
        float | None,
        typer.Option(
            "--retain-days",
            help="s3:// only: set S3 Object Lock retention on every object for this many days (the bucket must "
            "have Object Lock). Without it the bucket's default retention, if any, applies.",
        ),
    ] = None,
    retain_mode: Annotated[
        str | None,
        typer.Option(
            "--retain-mode", help="GOVERNANCE or COMPLIANCE [default: the bucket default rule's mode, else GOVERNANCE]."
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Write the events older than --before as verifiable segment files with a manifest, then prune them
    (the prune's checkpoint records the manifest's SHA-256). Check with `audit verify --from-archive`."""
    from mrtr_keys.audit.events import parse_when
    from mrtr_keys.audit.retention.archive import archive as archive_store
    from mrtr_keys.audit.retention.archive_dest import open_destination
    from mrtr_keys.cli.output import print_json, print_line

    cutoff = parse_when(before)
    dest = open_destination(to, retain_days=retain_days, retain_mode=retain_mode)
    _refuse_inside_gate_window(cutoff, keystore_)
    keys = _chain_keys(keystore_, "audit archive")
    store = _open(audit, keystore_)
    path = checkpoints or _default_checkpoints(keystore_)
    progress = progress_lines("archive")

    try:
        with locked_docs(path, store) as docs:
            result = archive_store(store, cutoff, docs, path, dest, progress=progress, keys=keys)
    finally:
        store.close()
    if json_:
        print_json(result.to_json())
    elif result.manifest is None:
        print_line(f"nothing to archive: no complete batch before {cutoff}")
    else:
        p = result.prune
        print_line(
            f"archived {plural(result.records, 'record')} of {plural(len(p.cuts), 'chain')} before {cutoff} in "
            f"{plural(result.segments, 'segment')} ({result.bytes:,} bytes) to {result.location}; "
            f"manifest {result.manifest}"
        )
        print_line(f"retention: {result.retention}")
        print_line(
            f"pruned {plural(p.deleted, 'record')} in {p.seconds:.1f} s; cut and manifest recorded in {p.checkpoint}"
        )
