"""`mrtr-keys fleet status`: every instance of this key ring, from its presence heartbeats.

One row an instance (name, codec, generation, primary kid, last heartbeat, live / stuck / stale /
stopped: stuck is a live instance whose ring watcher has completed no check in 3 intervals), in 80
columns; ``--json`` gives every field (`mrtr_keys.fleet.presence.InstanceRecord` plus ``status``,
``current`` (live and not stuck), ``age_seconds``, ``applied`` (it has loaded the stored ring's generation and
its watcher is not stuck), ``primary_format``: ``mk2``, ``mk1``, or ``sdk-v1`` for the MCP SDK's own key, and
``primary_seals``, ``primary_budget``, ``primary_used``: the primary's fleet-wide seals, never below the truth,
against its seal budget). Instances of other rings in the same store, and rows whose last heartbeat is older than
``--since`` (default 1h), are left out. Below the rows, one line gives each usable key's use of its seal budget, and
a key at 50 % of it or past it gets the warning sentence (`mrtr_keys.fleet.usage_view.budget_note`). When the ring holds
a revoked key, a line says which live instances have applied its revocation (`mrtr_keys.fleet.applied`) and names
the others.
"""

from __future__ import annotations

import textwrap
import time
from typing import Annotated, Any

import typer

from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, keystore
from mrtr_keys.errors import ConfigError, MrtrKeysError

app = typer.Typer(help="The instances serving this key ring, as their heartbeats report them.", no_args_is_help=True)

WIDTH = 80
COLUMNS = (("generation", 5), ("primary", 8), ("heartbeat", 9), ("status", 7))


def _ago(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s ago"
    if s < 7200:
        return f"{s // 60}m ago"
    return f"{s // 3600}h ago"


def _fit(text: str, width: int) -> str:
    """`text` in `width` characters; a longer one keeps its end (pod names differ at the end)."""
    return text if len(text) <= width else "…" + text[-(width - 1) :]


@app.command("status")
def status(
    keystore_: KeystoreOpt = None,
    since: Annotated[
        str, typer.Option("--since", help="Leave out instances silent for longer: 1h, 15m, 2d or ISO 8601.")
    ] = "1h",
    json_: JsonOpt = False,
) -> None:
    """One row an instance: name, codec, generation, primary kid, last heartbeat, live / stuck / stale /
    stopped (stuck: live, but its ring watcher completed no check in 3 intervals).

    A primary that is the MCP SDK's own key (a ring started with 'init --from-sdk-key-file') gets a
    note line; '--json' gives each row's 'primary_format' ('mk1' or 'sdk-v1')."""
    from mrtr_keys.audit.events import parse_event_time, parse_when
    from mrtr_keys.audit.writing.stores.url import existing_store
    from mrtr_keys.cli.options import root_audit
    from mrtr_keys.cli.output import error, print_json, print_line
    from mrtr_keys.fleet.presence import read_instances
    from mrtr_keys.fleet.usage_view import read_usage

    store = keystore(keystore_)
    ring, unreachable = None, None
    try:
        ring = store.load()
    except MrtrKeysError as exc:  # presence lives in the audit store: say so and show every ring's instances
        unreachable = f"keystore: {exc}; showing the instances of every ring in the audit store"
    audit = existing_store(store, audit=root_audit())
    if audit is None:
        raise ConfigError("no audit store for this key ring (auditing off, or nothing recorded yet): no presence")
    horizon = parse_event_time(parse_when(since)).timestamp()
    now = time.time()
    try:
        rows = [
            r
            for r in read_instances(audit)
            if (ring is None or r.ring_id == ring.ring_id) and parse_event_time(r.beat).timestamp() >= horizon
        ]
        revocation = _revocation(audit, ring) if ring is not None else None
        usage = read_usage(audit, ring) if ring is not None else None
    finally:
        audit.close()
    formats = {k.kid: k.format.value for k in ring.keys} if ring else {}  # mk2, mk1, or sdk-v1: the SDK's own key
    if json_:
        target = ring.generation if ring else None
        print_json(
            [
                {
                    **r.to_json(now),
                    "applied": target is not None and (r.generation or 0) >= target and not r.watcher_stuck,
                    **_primary_use(ring, usage, r.primary_kid),
                    "primary_format": formats.get(r.primary_kid or ""),
                }
                for r in rows
            ]
        )
        if unreachable:
            error(unreachable)
        return
    counts = {s: sum(r.shown(now) == s for r in rows) for s in ("live", "stuck", "stale", "stopped")}
    if not counts["stuck"]:
        del counts["stuck"]
    head = f"key ring {ring.ring_id} generation {ring.generation}" if ring else "every key ring"
    print_line(f"{head}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    if unreachable:
        print_line(_wrap(unreachable, "  "))
    codec_w = max([5, *(len(r.codec or "-") for r in rows)])
    codec_w = min(codec_w, 13)
    name_w = WIDTH - codec_w - sum(w for _, w in COLUMNS) - 2 * (len(COLUMNS) + 1)
    widths = [name_w, codec_w, *(w for _, w in COLUMNS)]
    header = ["instance", "codec", "gen", "primary", "heartbeat", "status"]
    print_line(_row(header, widths))
    notes = []
    for r in rows:
        cells = [
            _fit(r.name, name_w),
            _fit(r.codec or "-", codec_w),
            str(r.generation if r.generation is not None else "-"),
            _fit(r.primary_kid or "-", 8),
            _ago(r.age(now)),
            r.shown(now),
        ]
        print_line(_row(cells, widths))
        if r.note and r.status(now) != "stopped":
            notes.append(_wrap(f"{r.name}: {r.note}", "  "))
    if ring is not None and usage is not None:
        for line in _use_lines(ring, usage):
            print_line(line)
    for note in notes:
        print_line(note)
    for kid in sorted({r.primary_kid for r in rows if r.primary_kid and formats.get(r.primary_kid) == "sdk-v1"}):
        print_line(f"  {kid}: the MCP SDK's own key, sealing its v1. tokens (docs/migration.md)")
    if revocation is not None:
        print_line(_wrap(revocation, ""))


def _revocation(audit: Any, ring: Any) -> str | None:
    """For the ring's latest revoked key: which live instances have applied the generation that revoked it."""
    from mrtr_keys.audit.writing.stores.base import Query
    from mrtr_keys.fleet.applied import applied
    from mrtr_keys.ring.model import format_time

    revoked = [k for k in ring.keys if k.revoked and k.revoked_at is not None]
    if not revoked:
        return None
    key = max(revoked, key=lambda k: k.revoked_at)
    found = audit.query(Query(op="revoke", kid=key.kid, newest_first=True, limit=1))
    target = found[0].event.generation if found and found[0].event.generation else ring.generation
    state = applied(audit, ring, target)
    return f"revoked {key.kid} at {format_time(key.revoked_at)}: {state.describe(time.time())}"


def _primary_use(ring: Any, usage: Any, kid: str | None) -> dict[str, Any]:
    """``primary_seals``, ``primary_budget`` and ``primary_used`` of an instance's primary (None when unknown)."""
    if ring is None or usage is None or not kid or ring.lookup(kid) is None:
        return {"primary_seals": None, "primary_budget": None, "primary_used": None}
    use = usage.of(ring, kid)
    return {"primary_seals": use["seals"], "primary_budget": use["budget"], "primary_used": use["used"]}


def _use_lines(ring: Any, usage: Any) -> list[str]:
    """One line with each usable key's use of its seal budget, then the warning of each key at 50 % or past."""
    from mrtr_keys.cli.keys_cmd import used_text
    from mrtr_keys.fleet.usage_view import budget_note
    from mrtr_keys.ring.budgets import WARN_AT

    if usage.totals is None:
        return [_wrap(usage.note, "")] if usage.note else []
    parts, warnings = [], []
    for key in ring.usable_keys():
        use = usage.of(ring, key.kid)
        parts.append(f"{key.kid} ({key.state.value}) {used_text(use['used'])} of {use['budget']:,}")
        if use["used"] is not None and use["used"] >= WARN_AT:
            warnings.append(_wrap(budget_note(key.kid, use["seals"], use["budget"]), "  "))
    return [_wrap("seal budgets used, fleet-wide: " + "; ".join(parts), ""), *warnings]


def _wrap(text: str, indent: str) -> str:
    """`text` wrapped at `WIDTH` columns at word boundaries (a note is never cut), continuation lines indented."""
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ", break_long_words=False)


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
