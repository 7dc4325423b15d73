"""`mrtr-keys keys list|show|destroy|ttl|budget|revoke`: the ring's keys (never material) with their fleet-wide
seal counts against their budgets, destroying a retired key's material, changing the TTL or a seal budget without
a rotation (`mrtr_keys.changes.lifecycle`, `mrtr_keys.changes.budget`), and revoking a leaked key
(`mrtr_keys.cli.revoke_cmd`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from mrtr_keys.cli import revoke_cmd
from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, keystore
from mrtr_keys.errors import ConfigError

app = typer.Typer(
    help="Show the key ring's keys and their use; destroy retired ones; change the TTL or a seal budget; revoke a "
    "leaked key.",
    no_args_is_help=True,
)
app.command("revoke")(revoke_cmd.revoke)

WideOpt = Annotated[bool, typer.Option("--wide", help="Every column, full ISO 8601 times (wider than 80 columns).")]
KidArg = Annotated[str, typer.Argument(help="Key id (8 hex characters, see: mrtr-keys keys list).")]
NARROW = ("kid", "state", "created_at", "promoted_at", "retired_at")
WIDE = (
    "kid",
    "state",
    "format",
    "created_at",
    "promoted_at",
    "demoted_at",
    "retired_at",
    "destroyed_at",
    "revoked_at",
    "seals",
    "budget",
    "used",
)


def _state(row: dict[str, Any]) -> str:
    """The state, ``destroyed`` for a retired key without material (a revoked key says ``revoked``)."""
    return "destroyed" if row.get("destroyed_at") and row["state"] == "retired" else str(row["state"])


def _state_and_format(row: dict[str, Any]) -> str:
    """The state, marked ``sdk`` for a key in the MCP SDK's format (docs/migration.md)."""
    return _state(row) + (" sdk" if row.get("format") == "sdk-v1" else "")


def _usage(store: Any, ring: Any) -> Any:
    """The ring's fleet-wide seal counts from its presence store (`mrtr_keys.fleet.usage_view.read_usage`); a
    store that cannot be opened is a note, as one that cannot be read: the keys are still shown."""
    from mrtr_keys.audit.writing.stores.url import existing_store
    from mrtr_keys.cli.options import root_audit
    from mrtr_keys.errors import AuditError
    from mrtr_keys.fleet.usage_view import UsageView, read_usage

    try:
        audit = existing_store(store, audit=root_audit())
    except AuditError as exc:
        return UsageView(None, f"seal counts unavailable: {exc}")
    try:
        return read_usage(audit, ring)
    finally:
        if audit is not None:
            audit.close()


def used_text(used: object) -> str:
    """The used fraction of a budget in 5 characters: ``12.3%``, ``<0.1%``, ``100%+``, or ``-`` when unknown."""
    if not isinstance(used, float | int):
        return "-"
    if used >= 1:
        return "100%+"
    if 0 < used < 0.001:
        return "<0.1%"
    return f"{used * 100:.1f}%"


@app.command("list")
def list_keys(keystore_: KeystoreOpt = None, wide: WideOpt = False, json_: JsonOpt = False) -> None:
    """List keys: kid, state (marked sdk for an MCP SDK key), created / promoted / retired, UTC, and the
    fraction of its seal budget each key has used fleet-wide (--wide: every time, to the microsecond, revoked
    included, the format, mk2, mk1 or sdk-v1, the seals and the budget). Without a presence store (auditing off)
    there is no fleet-wide count: one line says so."""
    from mrtr_keys.cli.output import print_json, print_line, print_table, short_time

    store = keystore(keystore_)
    ring = store.load()
    usage = _usage(store, ring)
    rows = [{**k.describe(), **usage.of(ring, k.kid)} for k in ring.keys]
    if json_:
        doc = {"ring_id": ring.ring_id, "generation": ring.generation, "codec": ring.codec.type}
        doc["seal_counts"] = "fleet" if usage.totals is not None else None
        if usage.note:
            doc["seal_counts_note"] = usage.note
        print_json({**doc, "keys": rows})
        return
    title = (
        f"key ring {ring.ring_id}, generation {ring.generation}, codec {ring.codec.type}, TTL {ring.ttl_seconds:g} s"
    )
    if wide:
        cells: dict[str, Callable[[dict[str, Any]], str]] = {"state": _state, "used": lambda r: used_text(r["used"])}
        print_table(title, WIDE, [[cells[c](r) if c in cells else r.get(c) for c in WIDE] for r in rows])
    else:
        headers = ["kid", "state", "created (UTC)", "promoted (UTC)", "retired (UTC)", "used"]
        table = [
            [r["kid"], _state_and_format(r), *(short_time(r[c]) for c in NARROW[2:]), used_text(r["used"])]
            for r in rows
        ]
        print_table(title, headers, table, compact=True, tight=True)
    if usage.note:
        print_line(usage.note)


@app.command("show")
def show(kid: KidArg, keystore_: KeystoreOpt = None, json_: JsonOpt = False) -> None:
    """One key: state, times, format, its fleet-wide seal, unseal and rejection counts against its seal budget,
    whether its material is held, and the ring it belongs to."""
    from mrtr_keys.cli.output import print_fields, print_json

    store = keystore(keystore_)
    ring = store.load()
    key = ring.lookup(kid)
    if key is None:
        raise ConfigError(f"no key {kid} in key ring {ring.ring_id} (see: mrtr-keys keys list)")
    usage = _usage(store, ring)
    info: dict[str, Any] = key.describe()
    info["state"] = _state(info)
    info.setdefault("destroyed_at", None)
    info["sealing"] = key.state.value == "primary"
    info["opening"] = key.usable
    info.update(usage.of(ring, kid))
    own = key.budget if key.budget is not None else ring.seal_budget
    info["budget_from"] = (
        "format" if own is None or own > info["budget"] else "key" if key.budget is not None else "ring"
    )  # a budget over the format's limit counts as the limit (`mrtr_keys.ring.budgets.budget_of`)
    info["material"] = "destroyed" if key.destroyed else ("held" if key.material or key.key_data else "none")
    info.update(ring_id=ring.ring_id, generation=ring.generation, codec=ring.codec.type)
    if usage.note:
        info["seal_counts_note"] = usage.note
    if json_:
        print_json(info)
    else:
        print_fields(f"key {kid}", {**info, "used": used_text(info["used"])})


@app.command("budget")
def budget(
    seals: Annotated[
        str | None,
        typer.Argument(help="Seals a key may make before it is due for rotation: 4000, 2^31; omit to show them."),
    ] = None,
    kid: Annotated[
        str | None,
        typer.Option("--kid", help="Only this key [default: every key of the ring, and the keys it makes later]."),
    ] = None,
    keystore_: KeystoreOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Show or set seal budgets (no rotation needed): by default each format's documented per-key limit halved
    (mk2 2^47, mk1 2^31; docs/token-format.md). At 50 % of it instances warn and 'rotate next --if-used-over 0.5'
    begins a rotation; past 100 % sealing goes on, audited 'over-budget'."""
    from mrtr_keys.changes.apply import apply_change
    from mrtr_keys.changes.budget import parse_seals, set_budget
    from mrtr_keys.cli.options import change_listeners
    from mrtr_keys.cli.output import print_json, print_table

    store = keystore(keystore_)
    if seals is None:
        ring = store.load()
        usage = _usage(store, ring)
        rows = [{"kid": k.kid, "state": _state(k.describe()), **usage.of(ring, k.kid)} for k in ring.keys]
        if json_:
            print_json({"ring_id": ring.ring_id, "seal_budget": ring.seal_budget, "keys": rows})
            return
        headers = ["kid", "state", "seals", "budget", "used"]
        table = [[r["kid"], r["state"], _count(r["seals"]), f"{r['budget']:,}", used_text(r["used"])] for r in rows]
        print_table(f"seal budgets of key ring {ring.ring_id}", headers, table, compact=True)
        return
    value = parse_seals(seals)
    result = apply_change(
        store, "budget", lambda ring, now: set_budget(ring, value, kid, now), listeners=change_listeners()
    )
    _print_result(result, json_)


def _count(n: object) -> str:
    return "-" if n is None else f"{n:,}"


@app.command("destroy")
def destroy(kid: KidArg, keystore_: KeystoreOpt = None, json_: JsonOpt = False) -> None:
    """Remove a retired key's material for good (the record stays); refused for any other state."""
    from mrtr_keys.changes.apply import apply_change
    from mrtr_keys.changes.lifecycle import destroy as destroy_key
    from mrtr_keys.cli.options import change_listeners

    store = keystore(keystore_)
    result = apply_change(store, "destroy", lambda ring, now: destroy_key(ring, kid, now), listeners=change_listeners())
    _print_result(result, json_)


@app.command("ttl")
def ttl(
    seconds: Annotated[
        str | None, typer.Argument(help="New TTL: seconds or 90m, 12h, 1d; omit to show the current one.")
    ] = None,
    keystore_: KeystoreOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Show or change the ring's TTL without a rotation: raising is at once, lowering takes two runs."""
    from mrtr_keys.changes.apply import apply_change
    from mrtr_keys.changes.lifecycle import parse_duration, set_ttl, ttl_info
    from mrtr_keys.cli.options import change_listeners
    from mrtr_keys.cli.output import print_fields, print_json

    store = keystore(keystore_)
    if seconds is None:
        info = ttl_info(store.load())
        print_json(info) if json_ else print_fields("TTL", info)
        return
    value = parse_duration(seconds, "TTL")
    last_old_seal = _last_old_seal(store)
    result = apply_change(
        store,
        "ttl",
        lambda ring, now: set_ttl(ring, value, now, last_old_seal=last_old_seal),
        listeners=change_listeners(),
    )
    _print_result(result, json_)


def _last_old_seal(store: Any) -> Any:
    """The audit log's last seal by an instance running before a pending lowering (None without one)."""
    ring = store.load()
    if ring.ttl_lowering is None:
        return None
    from mrtr_keys.audit.writing.stores.url import existing_store
    from mrtr_keys.cli.options import root_audit

    audit = existing_store(store, audit=root_audit())
    if audit is None:
        return None
    from mrtr_keys.fleet.ttl_evidence import last_seal_by_earlier_instances

    return last_seal_by_earlier_instances(audit, ring.ttl_lowering.requested_at, ring.ttl_seconds)


def _print_result(result: Any, json_: bool) -> None:
    from mrtr_keys.cli.output import print_change

    print_change(result, json_)
