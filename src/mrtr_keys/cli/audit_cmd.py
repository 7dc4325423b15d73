"""`mrtr-keys audit tail|query|stats|checkpoint|export|fingerprint`: read the token audit log.

``verify`` is in `mrtr_keys.cli.audit_verify_cmd`, ``prune`` in `mrtr_keys.cli.audit_prune_cmd`.

The store is ``--audit URL`` / ``MRTR_KEYS_AUDIT``, else ``audit.db`` beside the key ring
(docs/audit.md). People get rich tables; ``--json`` gives a JSON array of events (the fields of
`mrtr_keys.audit.events.FIELDS`), or of ``{key, count}`` rows for ``stats``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mrtr_keys.cli.audit_options import AuditOpt, LedgerOpt, OldToOpt, checkpoints_option
from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, root_state_dir
from mrtr_keys.errors import AuditError, ConfigError

if TYPE_CHECKING:
    from mrtr_keys.audit.writing.stores.base import AuditStore, Query
    from mrtr_keys.keystores import Keystore

app = typer.Typer(help="The token audit log: every seal, unseal and key ring change.", no_args_is_help=True)

SinceOpt = Annotated[str | None, typer.Option("--since", help="From this time: 1h, 15m, 2d, or ISO 8601.")]
UntilOpt = Annotated[str | None, typer.Option("--until", help="Before this time: 1h, 15m, 2d, or ISO 8601.")]


def _keystore(location: str | None) -> Keystore:
    from mrtr_keys.keystores import open_keystore

    return open_keystore(location, state_dir=root_state_dir())


def _open(audit: str | None, keystore_: str | None, *, must_exist: bool = True) -> AuditStore:
    from mrtr_keys.audit.writing.stores.sqlite import path_from_url
    from mrtr_keys.audit.writing.stores.url import open_store, store_url
    from mrtr_keys.cli.options import root_audit

    url = store_url(audit if audit is not None else root_audit(), _keystore(keystore_))
    if url is None:
        raise ConfigError("auditing is off (--audit off / MRTR_KEYS_AUDIT=off): there is no audit log to read")
    scheme = url.partition(":")[0].lower()
    if must_exist and scheme in ("sqlite", "jsonl"):
        path = path_from_url(url.replace("jsonl:", "sqlite:", 1))
        if not path.exists():
            raise ConfigError(f"no audit log at {path} (nothing recorded yet, or use --audit URL)")
    return open_store(url)


def _chain_keys(keystore_: str | None, command: str) -> Any:
    """The chain keys `command` verifies links with, read as the writers read theirs (exit 2 without)."""
    from mrtr_keys.audit.writing.chain_key import verifier_keys

    return verifier_keys(_keystore(keystore_).directory, command)


def _query(
    *,
    since: str | None = None,
    until: str | None = None,
    kid: str | None = None,
    audience: str | None = None,
    op: str | None = None,
    outcome: str | None = None,
    reason: str | None = None,
    client: str | None = None,
    instance: str | None = None,
    fingerprint: str | None = None,
    limit: int | None = None,
    newest_first: bool = False,
) -> Query:
    from mrtr_keys.audit.events import OK, OPS, REJECTED, parse_when
    from mrtr_keys.audit.writing.stores.base import Query

    if op is not None and op not in OPS:
        raise ConfigError(f"--op must be one of {', '.join(OPS)}")
    if outcome is not None and outcome not in (OK, REJECTED):
        raise ConfigError(f"--outcome must be {OK} or {REJECTED}")
    if limit is not None and limit < 1:
        raise ConfigError("--limit must be at least 1")
    return Query(
        since=parse_when(since) if since else None,
        until=parse_when(until) if until else None,
        kid=kid,
        audience=audience,
        op=op,
        outcome=outcome,
        reason=reason,
        client=client,
        instance=instance,
        fingerprint=fingerprint,
        limit=limit,
        newest_first=newest_first,
    )


WideOpt = Annotated[bool, typer.Option("--wide", help="Every field (wider than 80 columns).")]


def _print_events(events: list[dict[str, Any]], json_: bool, title: str | None = None, wide: bool = False) -> None:
    from mrtr_keys.audit.events import FIELDS
    from mrtr_keys.cli.event_table import NARROW_HEADERS, narrow_row
    from mrtr_keys.cli.output import print_json, print_table

    if json_:
        print_json(events)
    elif wide:
        print_table(title, FIELDS, [[e[f] for f in FIELDS] for e in events])
    else:
        print_table(title, NARROW_HEADERS, [narrow_row(e) for e in events], compact=True)


@app.command("tail")
def tail(
    keystore_: KeystoreOpt = None,
    audit: AuditOpt = None,
    lines: Annotated[int, typer.Option("-n", "--lines", help="How many of the newest events to show.")] = 20,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing new events (Ctrl-C stops).")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between polls with -f.")] = 0.5,
    wide: WideOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Show the newest events; with -f keep following (with --json: one JSON object a line)."""
    from mrtr_keys.audit.writing.stores.base import Query

    if follow and not 0.05 <= interval <= 86400:  # NaN too; 0 polled the store in a busy loop
        raise ConfigError("--interval must be a number of seconds from 0.05 to 86400")
    store = _open(audit, keystore_)
    recent = list(reversed(store.query(Query(newest_first=True, limit=max(lines, 0)))))
    events = [r.event.to_json() for r in recent]
    last = max((r.position for r in recent), default=0)
    if not follow:
        _print_events(events, json_, "audit log (newest last)", wide)
        return
    if last == 0:
        newest = store.query(Query(newest_first=True, limit=1))
        last = newest[0].position if newest else 0
    for ev in events:
        _emit_follow(ev, json_, wide)
    try:
        while True:
            time.sleep(interval)
            for r in store.query(Query(after_position=last)):
                last = max(last, r.position)
                _emit_follow(r.event.to_json(), json_, wide)
    except KeyboardInterrupt:
        return


def _emit_follow(ev: dict[str, Any], json_: bool, wide: bool) -> None:
    from mrtr_keys.audit.events import FIELDS
    from mrtr_keys.cli.event_table import narrow_row, wide_row

    if json_:
        sys.stdout.write(json.dumps(ev) + "\n")
    else:
        sys.stdout.write("  ".join(wide_row(ev, FIELDS) if wide else narrow_row(ev)) + "\n")
    sys.stdout.flush()


@app.command("query")
def query(
    keystore_: KeystoreOpt = None,
    audit: AuditOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    kid: Annotated[str | None, typer.Option("--kid", help="Only this key id.")] = None,
    audience: Annotated[str | None, typer.Option("--audience", help="Only this audience.")] = None,
    op: Annotated[
        str | None,
        typer.Option("--op", help="seal, unseal, ring-loaded, init, begin, promote, retire, rewrap, audience."),
    ] = None,
    outcome: Annotated[str | None, typer.Option("--outcome", help="ok or rejected.")] = None,
    reason: Annotated[
        str | None,
        typer.Option("--reason", help="Rejection reason (expired, seal, ...), forced, fenced-out or over-budget."),
    ] = None,
    client: Annotated[str | None, typer.Option("--client", help="Only this sidecar client.")] = None,
    instance: Annotated[str | None, typer.Option("--instance", help="Only this instance (host:pid:start).")] = None,
    token: Annotated[
        str | None, typer.Option("--token", help="Follow one token's life (matched by its fingerprint).")
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="At most this many (the newest).")] = None,
    wide: WideOpt = False,
    json_: JsonOpt = False,
) -> None:
    """Events matching every filter given, oldest first."""
    from mrtr_keys.audit.events import plural

    fingerprint = None
    if token is not None:
        fingerprint = _fingerprinter(keystore_).fingerprint(canonical_spelling(token))
    q = _query(
        since=since,
        until=until,
        kid=kid,
        audience=audience,
        op=op,
        outcome=outcome,
        reason=reason,
        client=client,
        instance=instance,
        fingerprint=fingerprint,
        limit=limit,
        newest_first=limit is not None,
    )
    store = _open(audit, keystore_)
    try:
        if q.newest_first:  # the newest --limit N, printed oldest first: N records, as the user asked
            records = store.query(q)
            records.reverse()
            _print_events([r.event.to_json() for r in records], json_, plural(len(records), "event"), wide)
        else:
            _stream_events((r.event.to_json() for r in store.iter_query(q)), json_, wide)
    finally:
        store.close()


TABLE_CHUNK = 1_000
"""Rows a table holds when ``audit query`` streams a long result (one table a chunk)."""


def _stream_events(events: Iterator[dict[str, Any]], json_: bool, wide: bool) -> None:
    """Print events as they are read: one JSON array written item by item, or tables of
    `TABLE_CHUNK` rows (a result that fits one chunk looks exactly as before)."""
    from itertools import islice

    from mrtr_keys.audit.events import plural
    from mrtr_keys.cli.output import stream_json_array

    if json_:
        stream_json_array(events)
        return
    chunk = list(islice(events, TABLE_CHUNK))
    if len(chunk) < TABLE_CHUNK:
        _print_events(chunk, False, plural(len(chunk), "event"), wide)
        return
    done = 0
    while chunk:
        _print_events(chunk, False, f"events {done + 1}-{done + len(chunk)}", wide)
        done += len(chunk)
        chunk = list(islice(events, TABLE_CHUNK))
    sys.stderr.write(f"mrtr-keys: {plural(done, 'event')}\n")


@app.command("stats")
def stats(
    by: Annotated[str, typer.Option("--by", help="kid, reason, audience, client or instance (also op, outcome).")],
    keystore_: KeystoreOpt = None,
    audit: AuditOpt = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
    op: Annotated[str | None, typer.Option("--op", help="Only this operation.")] = None,
    outcome: Annotated[str | None, typer.Option("--outcome", help="Only ok or rejected.")] = None,
    json_: JsonOpt = False,
) -> None:
    """Count events grouped by one field, most frequent first."""
    from mrtr_keys.audit.events import STATS_KEYS
    from mrtr_keys.cli.output import print_json, print_table

    if by not in STATS_KEYS:
        raise ConfigError(f"--by must be one of {', '.join(STATS_KEYS)}")
    rows = _open(audit, keystore_).stats(by, _query(since=since, until=until, op=op, outcome=outcome))
    if json_:
        print_json([{"key": k, "count": n} for k, n in rows])
    else:
        print_table(f"events by {by}", [by, "count"], rows)


def _default_checkpoints(keystore_: str | None) -> Path:
    """The checkpoint file: ``MRTR_KEYS_AUDIT_CHECKPOINTS``, else ``audit-checkpoints.jsonl`` in the state directory."""
    import os

    env = os.environ.get("MRTR_KEYS_AUDIT_CHECKPOINTS")
    if env:
        return Path(env)
    return _keystore(keystore_).directory / "audit-checkpoints.jsonl"


def _trusted_records(sources: list[str] | None, keystore_: str | None) -> tuple[list[dict[str, Any]], list[Path]]:
    """Every record of `sources` (``--checkpoints``, repeated; default: the checkpoint file and
    ``MRTR_KEYS_AUDIT_ANCHOR``), in order, and which of them are checkpoint files (what a prune appends to).

    Raises:
        ConfigError: a bad location or record; AuditUnavailable: one cannot be read now.
    """
    import os

    from mrtr_keys.audit.verifying.ledger import FileLedger, open_ledger

    if not sources:
        sources = [str(_default_checkpoints(keystore_))]
        anchor = os.environ.get("MRTR_KEYS_AUDIT_ANCHOR", "").strip()
        if anchor:
            sources.append(anchor)
    docs: list[dict[str, Any]] = []
    files: list[Path] = []
    for where in sources:
        ledger = open_ledger(where)
        docs += ledger.read()
        if isinstance(ledger, FileLedger):
            files.append(ledger.path)
    return docs, files


@app.command("checkpoint")
def checkpoint(
    keystore_: KeystoreOpt = None,
    audit: AuditOpt = None,
    checkpoints: LedgerOpt = None,
    old_to: OldToOpt = None,
    full: Annotated[
        bool, typer.Option("--full", help="Read the whole log, not only what was added since the last checkpoint.")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Record every chain's head (last seq and hash) so `verify` can detect a cut-off tail; reads only
    what was added since the last checkpoint in the file (--full: everything). Refuses (exit 1) when the
    file records this store's chains under another store id (its id was rewritten)."""
    from mrtr_keys.audit.events import plural
    from mrtr_keys.audit.verifying.checkpoint_since import make_checkpoint_since
    from mrtr_keys.audit.verifying.ledger import open_ledger
    from mrtr_keys.audit.verifying.store_match import checkpoints_of, id_break
    from mrtr_keys.cli.output import error, print_json, print_line, print_table

    keys = _chain_keys(keystore_, "audit checkpoint")
    store = _open(audit, keystore_)
    path = checkpoints_option("checkpoint", checkpoints, old_to) or _default_checkpoints(keystore_)
    ledger = open_ledger(path)
    try:
        matched = checkpoints_of(ledger.read(), store)
        doc = make_checkpoint_since(store, matched.docs, now=time.time(), full=full, keys=keys)
    finally:
        store.close()
    heads = [str(h["writer"]) for h in doc.get("heads", [])]
    if matched.claimed(heads):  # its chains are another store id's: recording them would hide a cut tail
        raise AuditError(f"checkpoint not recorded: {id_break(store, matched, heads)}")
    if matched.replaced:  # recorded all the same: the first checkpoint of a store made where another was
        error(
            f"warning: {path} records {store.url} only under {plural(len(matched.other_ids), 'other store id')}; "
            f"this store's id is {doc.get('store_id')}: their checkpoints do not apply to it"
        )
    ledger.append(doc)
    if json_:
        print_json({**doc, "written_to": ledger.uri})
    else:
        print_table(
            f"checkpoint {doc['time']}",
            ["writer", "seq", "hash"],
            [(h["writer"], h["seq"], h["hash"]) for h in doc["heads"]],
        )
        print_line(f"appended to {ledger.uri}")


@app.command("export")
def export(
    keystore_: KeystoreOpt = None,
    audit: AuditOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="jsonl (verifiable: includes the chain) or csv.")] = "jsonl",
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write here instead of stdout.")] = None,
    since: SinceOpt = None,
    until: UntilOpt = None,
) -> None:
    """Every event with its chain fields, in storage order (a progress bar on long exports)."""
    import csv

    from rich.console import Console
    from rich.progress import Progress

    from mrtr_keys.audit.writing.stores.base import SQL_COLUMNS

    if fmt not in ("jsonl", "csv"):
        raise ConfigError("--format must be jsonl or csv")
    store = _open(audit, keystore_)
    q = _query(since=since, until=until)
    total = store.count()
    try:
        out = output.open("w", encoding="utf-8", newline="") if output else sys.stdout
    except OSError as exc:
        raise ConfigError(f"cannot write {output}: {exc.strerror}") from None
    writer = csv.writer(out, lineterminator="\n") if fmt == "csv" else None
    if writer is not None:
        writer.writerow(SQL_COLUMNS)
    try:
        with Progress(console=Console(stderr=True), transient=True, disable=total < 10_000) as progress:
            task = progress.add_task("exporting", total=total)
            for n, r in enumerate(store.records(), 1):
                if q.matches(r):
                    doc = r.to_json()
                    if writer is not None:
                        writer.writerow(["" if doc[c] is None else doc[c] for c in SQL_COLUMNS])
                    else:
                        out.write(json.dumps(doc, separators=(",", ":")) + "\n")
                if n % 1000 == 0:
                    progress.update(task, completed=n)
    finally:
        if output:
            out.close()


def canonical_spelling(token: str) -> str:
    from mrtr_keys.audit.writing.fingerprint import canonical_spelling as respell

    return respell(token)


def _fingerprinter(keystore_: str | None) -> Any:
    from mrtr_keys.audit.writing.fingerprint import Fingerprinter, load_audit_key

    return Fingerprinter(load_audit_key(_keystore(keystore_).directory, create=False))


@app.command("fingerprint")
def fingerprint(
    token: Annotated[str, typer.Argument(help="A requestState token (never stored or printed).")],
    keystore_: KeystoreOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Print the fingerprint that audit events for TOKEN carry (keyed by the audit key beside the ring).

    TOKEN may be respelled with the standard base64 alphabet and padding: the fingerprint is then
    the canonical token's (the one its events carry)."""
    from mrtr_keys.cli.output import print_json, print_line

    fp = _fingerprinter(keystore_).fingerprint(canonical_spelling(token))
    if json_:
        print_json({"fingerprint": fp})
    else:
        print_line(fp)
