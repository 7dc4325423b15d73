"""`mrtr-keys rotate status|begin|promote|retire|next|abort|restore`: three-phase rotation (`ring.rotation`).

``promote``, ``retire`` and ``next`` take ``--wait DURATION`` (``900``, ``15m``): wait for the gates
(`mrtr_keys.changes.wait`) with a live progress line on stderr (instances ready N of M, the TTL
countdown); exit 0 when the step is done, 75 only when the wait runs out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from mrtr_keys.cli.options import JsonOpt, KeyFormatOpt, KeystoreOpt, keystore
from mrtr_keys.errors import ConfigError
from mrtr_keys.ring.document import parse_ring

if TYPE_CHECKING:
    from mrtr_keys.changes.apply import ChangeResult

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
        help="Count an instance only if its last heartbeat is younger than this many seconds [default: 3 of "
        "its heartbeat intervals]; a step that passes only thanks to a narrower window is recorded as forced.",
        show_default=False,
    ),
]
WaitOpt = Annotated[
    str | None,
    typer.Option(
        "--wait",
        metavar="DURATION",
        help="Wait up to DURATION (seconds, or 90s, 15m, 1h) for the gates (progress on stderr); exit 75 only if "
        "they are still closed then.",
    ),
]


@app.command("status")
def status(keystore_: KeystoreOpt = None, json_: JsonOpt = False) -> None:
    """Say the phase in one sentence, the keys involved, the next step and everything it waits for, and how much
    of its seal budget the primary has used fleet-wide."""
    from mrtr_keys.audit.writing.stores.url import existing_store
    from mrtr_keys.changes.rotation import status as rotation_status
    from mrtr_keys.cli.options import root_audit
    from mrtr_keys.cli.output import print_fields, print_json, print_line
    from mrtr_keys.fleet.gates import describe, evaluate
    from mrtr_keys.fleet.usage_view import budget_note, read_usage
    from mrtr_keys.ring.budgets import WARN_AT
    from mrtr_keys.ring.model import utcnow

    store = keystore(keystore_)
    ring = store.load()
    now = utcnow()
    st = rotation_status(ring, now).to_json()
    audit = existing_store(store, audit=root_audit())
    report = evaluate(audit, ring, now)
    usage = read_usage(audit, ring)
    use = usage.of(ring, ring.primary.kid)
    st.update(
        {
            "generation": ring.generation,
            "ttl_seconds": ring.ttl_seconds,
            "wait_seconds": round(max(st["wait_seconds"], report.wait_seconds), 3),
            "sentence": describe(report, ring, now),
            "waits": [w.to_json() for w in report.waits],
            "target_generation": report.target,
            "instances_live": len(report.live),
            "instances_ready": report.ready,
            "primary_seals": use["seals"],
            "primary_budget": use["budget"],
            "primary_used": use["used"],
        }
    )
    if usage.note:
        st["seal_counts_note"] = usage.note
    if json_:
        print_json(st)
        return
    print_line(st["sentence"])
    print_fields(f"rotation of {ring.ring_id}", {k: v for k, v in st.items() if k not in ("sentence", "waits")})
    for w in report.waits:
        print_line(f"waiting for {w.what}: {w.detail}")
    for key in ring.usable_keys():
        k_use = usage.of(ring, key.kid)
        if k_use["used"] is not None and k_use["used"] >= WARN_AT:
            print_line(budget_note(key.kid, k_use["seals"], k_use["budget"]))


def _step(
    step: str,
    keystore_: str | None,
    json_: bool,
    *,
    force: bool = False,
    ttl: float | None = None,
    window: float | None = None,
    wait: str | None = None,
    if_older_than: str | None = None,
    if_used_over: str | None = None,
    key_format: str | None = None,
) -> None:
    from mrtr_keys.changes.lifecycle import parse_duration
    from mrtr_keys.changes.rotation import run_step
    from mrtr_keys.cli.options import change_listeners, root_audit
    from mrtr_keys.fleet.compat_gate import readers_check_for
    from mrtr_keys.fleet.gates import rotation_gate_for

    seconds = None if wait is None else parse_duration(wait, "--wait")
    store = keystore(keystore_)
    if if_older_than is not None or if_used_over is not None:
        skip = _not_due(store, if_older_than, if_used_over)
        if skip is not None:
            _print(skip, json_)
            return
    gate = rotation_gate_for(store, audit=root_audit(), window=window)  # the audit store's gates; None without one
    check = readers_check_for(
        store, audit=root_audit(), what=f"rotate {step}", instead="make an mk1 key: --key-format mk1"
    )
    options: dict[str, Any] = {
        "force": force,
        "ttl": ttl,
        "gate": gate,
        "listeners": change_listeners(),
        "check": check,
        "key_format": key_format,
    }
    if seconds is None:
        result = run_step(store, step, **options)
    else:
        from mrtr_keys.changes.wait import run_step_waiting
        from mrtr_keys.cli.progress import WaitProgress

        with WaitProgress(store, window=window) as progress:
            result = run_step_waiting(store, step, wait=seconds, on_wait=progress.update, **options)
    _print(result, json_)


MAX_OLDER_THAN = 36500 * 86400.0
"""Longest ``--if-older-than`` (seconds, 100 years): beyond it the due date it prints cannot be a datetime."""


def _not_due(store: Any, if_older_than: str | None, if_used_over: str | None) -> ChangeResult | None:
    """`mrtr_keys.changes.budget.not_due` for ``rotate next --if-older-than`` / ``--if-used-over``, with the
    primary's fleet-wide seal count from the presence store.

    Raises:
        ConfigError: ``--if-used-over`` alone and no presence store to count seals in (the CronJob would never
            rotate by use: say so, exit 2); with ``--if-older-than`` too, the age alone decides and one line says so.
    """
    from mrtr_keys.audit.writing.stores.url import existing_store
    from mrtr_keys.changes.budget import not_due, parse_fraction
    from mrtr_keys.changes.lifecycle import parse_duration
    from mrtr_keys.cli.options import root_audit
    from mrtr_keys.cli.output import error
    from mrtr_keys.fleet.usage_view import read_usage
    from mrtr_keys.ring.model import utcnow

    older = None if if_older_than is None else parse_duration(if_older_than, "--if-older-than")
    if older is not None and older > MAX_OLDER_THAN:  # its due date would be past what a datetime holds
        raise ConfigError("--if-older-than must be at most 36500d (100 years)")
    fraction = None if if_used_over is None else parse_fraction(if_used_over)
    ring = store.load()
    seals = None
    if fraction is not None:
        audit = existing_store(store, audit=root_audit())
        try:
            usage = read_usage(audit, ring)
        finally:
            if audit is not None:
                audit.close()
        seals = usage.of(ring, ring.primary.kid)["seals"]
        if seals is None:
            if older is None:
                raise ConfigError(f"--if-used-over needs fleet-wide seal counts; {usage.note}")
            error(f"--if-used-over is not applied, only --if-older-than: {usage.note}")
    return not_due(ring, utcnow(), older_than=older, used_over=fraction, seals=seals)


def _print(result: ChangeResult, json_: bool) -> None:
    from mrtr_keys.cli.output import print_change

    print_change(result, json_, with_forced=True)


@app.command("begin")
def begin(
    keystore_: KeystoreOpt = None, ttl: TtlOpt = None, key_format: KeyFormatOpt = None, json_: JsonOpt = False
) -> None:
    """Phase 1: add a new key that verifies; the old one still seals. A new key of a format some live instance
    cannot read (mk2 before 0.2.0) is refused with exit 75, naming them."""
    _step("begin", keystore_, json_, ttl=ttl, key_format=key_format)


@app.command("promote")
def promote(
    keystore_: KeystoreOpt = None,
    force: PromoteForceOpt = False,
    window: WindowOpt = None,
    wait: WaitOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Phase 2: the new key seals; the old one still verifies. Waits for every live instance to load phase 1."""
    _step("promote", keystore_, json_, force=force, window=window, wait=wait)


@app.command("retire")
def retire(
    keystore_: KeystoreOpt = None,
    force: ForceOpt = False,
    window: WindowOpt = None,
    wait: WaitOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Phase 3: retire the old key, once TTL + 60 s have passed since the promote and every live instance
    has loaded phase 2."""
    _step("retire", keystore_, json_, force=force, window=window, wait=wait)


@app.command("next")
def next_(
    keystore_: KeystoreOpt = None,
    force: ForceOpt = False,
    ttl: TtlOpt = None,
    window: WindowOpt = None,
    wait: WaitOpt = None,
    if_older_than: Annotated[
        str | None,
        typer.Option(
            "--if-older-than",
            help="Scheduled rotation: start one only if the primary has sealed this long (30d, 12h, 90m); "
            "while it is younger, do nothing and exit 0.",
        ),
    ] = None,
    if_used_over: Annotated[
        str | None,
        typer.Option(
            "--if-used-over",
            metavar="FRACTION",
            help="Rotation by use: start one only if the primary has sealed more than this fraction of its seal "
            "budget fleet-wide (0.5 or 50%); with --if-older-than either one starts it. Otherwise do nothing, exit 0.",
        ),
    ] = None,
    key_format: KeyFormatOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Run the next phase if allowed now (with --wait: once allowed); else exit 75 saying what it waits for."""
    _step(
        "next",
        keystore_,
        json_,
        force=force,
        ttl=ttl,
        window=window,
        wait=wait,
        if_older_than=if_older_than,
        if_used_over=if_used_over,
        key_format=key_format,
    )


@app.command("abort")
def abort(keystore_: KeystoreOpt = None, json_: JsonOpt = False) -> None:
    """Undo a begin before promote (the new key is removed); refused once promoted."""
    from mrtr_keys.changes.apply import apply_change
    from mrtr_keys.changes.lifecycle import abort as abort_rotation
    from mrtr_keys.cli.options import change_listeners

    _print(apply_change(keystore(keystore_), "abort", abort_rotation, listeners=change_listeners()), json_)


@app.command("restore")
def restore(
    backup: Annotated[str, typer.Argument(help="A key ring file saved earlier (same ring_id).")],
    keystore_: KeystoreOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Write a backup of this ring back as its next generation (instances refuse a lower generation)."""
    from mrtr_keys.changes.restore import restore as restore_ring
    from mrtr_keys.cli.options import change_listeners
    from mrtr_keys.cli.output import print_json, print_line

    result = restore_ring(keystore(keystore_), parse_ring(_read_backup(backup)), listeners=change_listeners())
    if json_:
        print_json({"step": "restore", "generation": result.ring.generation, "message": result.message})
    else:
        print_line(result.message)


def _read_backup(backup: str) -> bytes:
    """The bytes of the ring file `backup`: a regular file of at most `MAX_RING_BYTES` (as a keystore reads a ring),
    opened without blocking, so a FIFO or ``/dev/zero`` named by mistake is one line, not a hang or all memory.

    Raises:
        ConfigError: it cannot be read, is not a regular file, or is larger than any key ring.
    """
    from mrtr_keys.files import read_small_file
    from mrtr_keys.keystores.file import MAX_RING_BYTES

    hint = " (give a key ring file saved earlier)"
    data = read_small_file(backup, "backup", MAX_RING_BYTES, not_regular=hint)
    if len(data) > MAX_RING_BYTES:
        raise ConfigError(
            f"cannot read backup {backup}: larger than {MAX_RING_BYTES:,} bytes, larger than any key ring"
        )
    return data
