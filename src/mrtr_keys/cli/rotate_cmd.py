"""`mrtr-keys rotate status|begin|promote|retire|next`: the three-phase rotation (see `mrtr_keys.ring.rotation`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from mrtr_keys.cli.options import JsonOpt, KeystoreOpt, keystore

if TYPE_CHECKING:
    from mrtr_keys.ring.apply import ChangeResult

app = typer.Typer(help="Three-phase zero-downtime key rotation.", no_args_is_help=True)

ForceOpt = Annotated[
    bool, typer.Option("--force", help="Retire before TTL + 60 s: tokens in flight under the old key get rejected.")
]
TtlOpt = Annotated[float | None, typer.Option("--ttl", help="New requestState TTL in seconds, stored in the ring.")]
PromoteForceOpt = Annotated[
    bool, typer.Option("--force", help="Promote although the audit log shows instances without the phase-1 ring.")
]
WindowOpt = Annotated[
    float | None,
    typer.Option(
        "--window",
        envvar="MRTR_KEYS_GATE_WINDOW",
        help="Promote gate: instances seen in the audit log this many seconds back must have loaded phase 1 "
        "[default: 600].",
        show_default=False,
    ),
]


@app.command("status")
def status(keystore_: KeystoreOpt = None, json_: JsonOpt = False) -> None:
    """Show the phase, the keys involved, the next step and how long it waits."""
    from mrtr_keys.cli.output import print_fields, print_json
    from mrtr_keys.ring.model import utcnow
    from mrtr_keys.ring.rotation import status as rotation_status

    ring = keystore(keystore_).load()
    st = rotation_status(ring, utcnow()).to_json()
    st.update({"generation": ring.generation, "ttl_seconds": ring.ttl_seconds})
    if json_:
        print_json(st)
    else:
        print_fields(f"rotation of {ring.ring_id}", st)


def _step(
    step: str,
    keystore_: str | None,
    json_: bool,
    *,
    force: bool = False,
    ttl: float | None = None,
    window: float | None = None,
    if_older_than: str | None = None,
) -> None:
    from mrtr_keys.audit.gates import rotation_gate_for
    from mrtr_keys.cli.options import change_listeners, root_audit
    from mrtr_keys.ring.rotation import run_step

    store = keystore(keystore_)
    if if_older_than is not None:
        from mrtr_keys.ring.lifecycle import parse_duration, younger_than
        from mrtr_keys.ring.model import utcnow

        skip = younger_than(store.load(), utcnow(), parse_duration(if_older_than, "--if-older-than"))
        if skip is not None:
            _print(skip, json_)
            return
    # the audit log's gates (docs/audit.md); None without a log
    gate = rotation_gate_for(store, audit=root_audit(), window=window)
    _print(run_step(store, step, force=force, ttl=ttl, gate=gate, listeners=change_listeners()), json_)


def _print(result: ChangeResult, json_: bool) -> None:
    from mrtr_keys.cli.output import print_json, print_line

    if json_:
        print_json(
            {
                "step": result.op,
                "changed": result.changed,
                "forced": result.forced,
                "generation": result.ring.generation,
                "message": result.message,
                **result.details,
            }
        )
    else:
        print_line(result.message)


@app.command("begin")
def begin(keystore_: KeystoreOpt = None, ttl: TtlOpt = None, json_: JsonOpt = False) -> None:
    """Phase 1: add a new key that verifies; the old one still seals."""
    _step("begin", keystore_, json_, ttl=ttl)


@app.command("promote")
def promote(
    keystore_: KeystoreOpt = None, force: PromoteForceOpt = False, window: WindowOpt = None, json_: JsonOpt = False
) -> None:
    """Phase 2: the new key seals; the old one still verifies."""
    _step("promote", keystore_, json_, force=force, window=window)


@app.command("retire")
def retire(keystore_: KeystoreOpt = None, force: ForceOpt = False, json_: JsonOpt = False) -> None:
    """Phase 3: retire the old key, once TTL + 60 s have passed since the promote."""
    _step("retire", keystore_, json_, force=force)


@app.command("next")
def next_(
    keystore_: KeystoreOpt = None,
    force: ForceOpt = False,
    ttl: TtlOpt = None,
    window: WindowOpt = None,
    if_older_than: Annotated[
        str | None,
        typer.Option(
            "--if-older-than",
            help="Scheduled rotation: start one only if the primary has sealed this long (30d, 12h, 90m); "
            "while it is younger, do nothing and exit 0.",
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Run the next phase if allowed now; else exit 75 saying what it waits for."""
    _step("next", keystore_, json_, force=force, ttl=ttl, window=window, if_older_than=if_older_than)


@app.command("abort")
def abort(keystore_: KeystoreOpt = None, json_: JsonOpt = False) -> None:
    """Undo a begin before promote (the new key is removed); refused once promoted."""
    from mrtr_keys.cli.options import change_listeners
    from mrtr_keys.ring.apply import apply_change
    from mrtr_keys.ring.lifecycle import abort as abort_rotation

    _print(apply_change(keystore(keystore_), "abort", abort_rotation, listeners=change_listeners()), json_)
