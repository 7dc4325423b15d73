"""`mrtr-keys audit prune --before 30d`: delete old events, keeping the proof (`mrtr_keys.audit.retention.prune`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from mrtr_keys.cli.audit_cmd import _chain_keys, _default_checkpoints, _keystore, _open
from mrtr_keys.cli.audit_options import AuditOpt, CheckpointsOpt, OldToOpt, checkpoints_option, progress_lines
from mrtr_keys.cli.options import JsonOpt, KeystoreOpt
from mrtr_keys.errors import ConfigError

GATE_MARGIN = 60.0
"""Seconds past the ring's TTL the retire gate may look back (docs/audit.md, Rotation gates)."""


def prune(
    before: Annotated[str, typer.Option("--before", help="Delete events older than this: 30d, 12w, or ISO 8601.")],
    keystore_: KeystoreOpt = None,
    audit: AuditOpt = None,
    checkpoints: CheckpointsOpt = None,
    old_to: OldToOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Delete events older than --before, chain by chain at batch boundaries, after verifying them and
    recording each chain's cut in the checkpoint file (`audit verify` then starts there)."""
    from mrtr_keys.audit.events import format_ts, parse_when, plural
    from mrtr_keys.audit.retention.prune import prune as prune_store
    from mrtr_keys.cli.output import print_json, print_line

    cutoff = parse_when(before)
    _refuse_inside_gate_window(cutoff, keystore_)
    keys = _chain_keys(keystore_, "audit prune")
    store = _open(audit, keystore_)
    path = Path(checkpoints_option("prune", checkpoints, old_to) or _default_checkpoints(keystore_))
    progress = progress_lines("prune")

    try:
        with locked_docs(path, store) as docs:
            result = prune_store(store, cutoff, docs, str(path), progress=progress, keys=keys)
    finally:
        store.close()
    if json_:
        print_json(result.to_json())
    elif not result.cuts and not result.deleted:
        print_line(f"nothing to prune: no complete batch before {cutoff}")
    else:
        print_line(
            f"pruned {plural(result.deleted, 'record')} before {cutoff} from {plural(len(result.cuts), 'chain')} in "
            f"{result.seconds:.1f} s; cut recorded in {result.checkpoint} at {format_ts(time.time())}"
        )


def _refuse_inside_gate_window(cutoff: str, keystore_: str | None) -> None:
    """The retire gate reads the last TTL of seal events: never prune inside the ring's TTL + 60 s.

    Raises:
        ConfigError: the cut-off is inside that window, or the key ring exists but cannot be read
        (a keystore outage or a damaged ring must not turn the check off).
    """
    from mrtr_keys.audit.events import format_ts
    from mrtr_keys.errors import KeyRingNotFound

    try:
        ring = _keystore(keystore_).load()
    except KeyRingNotFound:  # no ring here (a store named by --audit alone): no gate reads this log
        return
    except Exception as exc:
        raise ConfigError(
            f"cannot read the key ring to keep --before out of the window the rotation gates read: {exc}"
        ) from None
    oldest = format_ts(time.time() - ring.ttl_seconds - GATE_MARGIN)
    if cutoff > oldest:
        raise ConfigError(
            f"--before {cutoff} is inside the window the rotation gates read (the ring's TTL, "
            f"{ring.ttl_seconds:g} s, plus {GATE_MARGIN:g} s): choose a time before {oldest}"
        )


@contextmanager
def locked_docs(path: Path, store: Any) -> Iterator[list[dict[str, Any]]]:
    """Hold the checkpoint file's pruner lock and yield its documents for `store` (by store id, else
    by URL: `mrtr_keys.audit.verifying.store_match`).

    Raises:
        AuditBusy: another prune or archive (or a sidecar's retention) holds the lock.
    """
    from mrtr_keys.audit.retention.prune import pruner_lock
    from mrtr_keys.audit.verifying.ledger import FileLedger
    from mrtr_keys.audit.verifying.store_match import checkpoints_of
    from mrtr_keys.errors import AuditBusy

    with pruner_lock(path) as held:
        if not held:
            raise AuditBusy(
                f"another prune or archive is using {path} (its .lock is held); nothing was changed, try again"
            )
        yield checkpoints_of(FileLedger(path).read(), store).docs
