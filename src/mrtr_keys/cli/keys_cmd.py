"""`mrtr-keys keys list|show|destroy|ttl|revoke`: the ring's keys (never material), destroying a retired
key's material, changing the TTL without a rotation (`mrtr_keys.changes.lifecycle`), and revoking a leaked
key (`mrtr_keys.cli.revoke_cmd`)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from mrtr_keys.cli import revoke_cmd
from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, keystore
from mrtr_keys.errors import ConfigError

app = typer.Typer(
    help="Show the key ring's keys; destroy retired ones; change the TTL; revoke a leaked key.", no_args_is_help=True
)
app.command("revoke")(revoke_cmd.revoke)

WideOpt = Annotated[bool, typer.Option("--wide", help="Every column, full ISO 8601 times (wider than 80 columns).")]
KidArg = Annotated[str, typer.Argument(help="Key id (8 hex characters, see: mrtr-keys keys list).")]
NARROW = ("kid", "state", "created_at", "promoted_at", "retired_at")
WIDE = ("kid", "state", "format", "created_at", "promoted_at", "demoted_at", "retired_at", "destroyed_at", "revoked_at")


def _state(row: dict[str, Any]) -> str:
    """The state, ``destroyed`` for a retired key without material (a revoked key says ``revoked``)."""
    return "destroyed" if row.get("destroyed_at") and row["state"] == "retired" else str(row["state"])


def _state_and_format(row: dict[str, Any]) -> str:
    """The state, marked ``sdk`` for a key in the MCP SDK's format (docs/migration.md)."""
    return _state(row) + (" sdk" if row.get("format") == "sdk-v1" else "")


@app.command("list")
def list_keys(keystore_: KeystoreOpt = None, wide: WideOpt = False, json_: JsonOpt = False) -> None:
    """List keys: kid, state (marked sdk for an MCP SDK key), created / promoted / retired, UTC (--wide:
    every time, to the microsecond, revoked included, and the format: mk1 or sdk-v1)."""
    from mrtr_keys.cli.output import print_json, print_table, short_time

    ring = keystore(keystore_).load()
    rows = [k.describe() for k in ring.keys]
    if json_:
        print_json({"ring_id": ring.ring_id, "generation": ring.generation, "codec": ring.codec.type, "keys": rows})
        return
    title = (
        f"key ring {ring.ring_id}, generation {ring.generation}, codec {ring.codec.type}, TTL {ring.ttl_seconds:g} s"
    )
    if wide:
        print_table(title, WIDE, [[_state(r) if c == "state" else r.get(c) for c in WIDE] for r in rows])
        return
    headers = ["kid", "state", "created (UTC)", "promoted (UTC)", "retired (UTC)"]
    table = [[r["kid"], _state_and_format(r), *(short_time(r[c]) for c in NARROW[2:])] for r in rows]
    print_table(title, headers, table, compact=True)


@app.command("show")
def show(kid: KidArg, keystore_: KeystoreOpt = None, json_: JsonOpt = False) -> None:
    """One key: state, times, whether its material is held, and the ring it belongs to."""
    from mrtr_keys.cli.output import print_fields, print_json

    ring = keystore(keystore_).load()
    key = ring.lookup(kid)
    if key is None:
        raise ConfigError(f"no key {kid} in key ring {ring.ring_id} (see: mrtr-keys keys list)")
    info: dict[str, Any] = key.describe()
    info["state"] = _state(info)
    info.setdefault("destroyed_at", None)
    info["seals"] = key.state.value == "primary"
    info["unseals"] = key.usable
    info["material"] = "destroyed" if key.destroyed else ("held" if key.material or key.key_data else "none")
    info.update(ring_id=ring.ring_id, generation=ring.generation, codec=ring.codec.type)
    if json_:
        print_json(info)
    else:
        print_fields(f"key {kid}", info)


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
    from mrtr_keys.audit.stores.url import existing_store
    from mrtr_keys.cli.options import root_audit

    audit = existing_store(store, audit=root_audit())
    if audit is None:
        return None
    from mrtr_keys.fleet.ttl_evidence import last_seal_by_earlier_instances

    return last_seal_by_earlier_instances(audit, ring.ttl_lowering.requested_at, ring.ttl_seconds)


def _print_result(result: Any, json_: bool) -> None:
    from mrtr_keys.cli.output import print_change

    print_change(result, json_)
