"""`mrtr-keys`: the command line. Thin: parses, calls the library, prints.

Exit codes: 0 done, 75 not yet (retry later, EX_TEMPFAIL), 2 usage or
configuration error, 1 anything else. Never a traceback (set
``MRTR_KEYS_DEBUG=1`` to see one).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Annotated, cast

import typer

from mrtr_keys.cli import (
    audit_archive_cmd,
    audit_cmd,
    audit_migrate_cmd,
    audit_prune_cmd,
    audit_verify_cmd,
    clients_cmd,
    fleet_cmd,
    health_cmd,
    init_cmd,
    inspect_cmd,
    keys_cmd,
    keystore_cmd,
    rewrap_cmd,
    rotate_cmd,
    scope_cmd,
    serve_cmd,
)
from mrtr_keys.cli.audit_options import RootAuditOpt
from mrtr_keys.cli.options import JsonOpt, StateDirOpt, set_root
from mrtr_keys.errors import MrtrKeysError
from mrtr_keys.urls import scrub

app = typer.Typer(
    name="mrtr-keys",
    help="Shared, rotated, audited keys for MCP requestState.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app.command("init")(init_cmd.init)
app.add_typer(keys_cmd.app, name="keys")
app.add_typer(rotate_cmd.app, name="rotate")
app.add_typer(fleet_cmd.app, name="fleet")
app.add_typer(scope_cmd.app, name="audience")
app.command("inspect")(inspect_cmd.inspect)
audit_cmd.app.command("verify")(audit_verify_cmd.verify)
audit_cmd.app.command("prune")(audit_prune_cmd.prune)
audit_cmd.app.command("archive")(audit_archive_cmd.archive)
audit_cmd.app.command("migrate")(audit_migrate_cmd.migrate)
app.add_typer(audit_cmd.app, name="audit")


def _print_version(value: bool) -> None:
    if value:
        from mrtr_keys.cli.output import print_line

        print_line(f"mrtr-keys {version()}")
        raise typer.Exit(0)


def version() -> str:
    """The installed package's version (``0.2.0``)."""
    from importlib.metadata import version as dist_version

    return dist_version("mrtr-keys")


@app.callback()
def _root(
    audit: RootAuditOpt = None,
    state_dir: StateDirOpt = None,
    log_format: Annotated[
        str | None,
        typer.Option("--log-format", envvar="MRTR_KEYS_LOG_FORMAT", help="Log lines as text or json [default: text]."),
    ] = None,
    _version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit."),
    ] = False,
) -> None:
    """Shared, rotated, audited keys for MCP requestState."""
    from mrtr_keys.keystores.state import configured_state_dir
    from mrtr_keys.logs import configure_logging

    configure_logging(log_format)
    chosen = configured_state_dir(state_dir)  # audit key, default audit log, client registry, lock files
    set_root(
        audit=audit, log_format=log_format, state_dir=str(chosen) if chosen is not None else None
    )  # ring changes, rotation gates and the sidecar use these


@app.command("version")
def version_cmd(json_: JsonOpt = False) -> None:
    """Print the versions of mrtr-keys, the MCP SDK and Python."""
    import platform
    from importlib.metadata import version as dist_version

    from mrtr_keys.cli.output import print_json, print_line

    info = {"mrtr_keys": version(), "mcp": dist_version("mcp"), "python": platform.python_version()}
    if json_:
        print_json(info)
    else:
        print_line(f"mrtr-keys {info['mrtr_keys']} (mcp {info['mcp']}, Python {info['python']})")


app.command("rewrap")(rewrap_cmd.rewrap)
app.command("serve")(serve_cmd.serve)
app.command("health")(health_cmd.health)
app.add_typer(clients_cmd.app, name="clients")
app.add_typer(keystore_cmd.app, name="keystore")


OUT_OF_MEMORY = (
    "out of memory: narrow the command (--since/--until, --limit, --op/--kid), or give it more memory "
    "(audit verify, prune and export read the log in bounded pages)"
)


@functools.cache
def command() -> typer.core.TyperGroup:
    """The Click command that `app` describes (``typer.main.get_command``), built once per process.

    Building it inspects the signature and annotations of every command: about 45 ms of CPU, which a
    process that runs several commands (a test harness, a fork server) would pay for each. The command
    holds no state between invocations (each gets its own Click context).
    """
    return cast(typer.core.TyperGroup, typer.main.get_command(app))  # a TyperGroup: `app` has subcommands


def run() -> None:
    """Console-script entry point: run the app, map errors to one line and an exit code."""
    from mrtr_keys.cli.output import error, json_requested, print_json_error

    try:
        code = command()(standalone_mode=False, prog_name="mrtr-keys")
    except MrtrKeysError as exc:
        error(str(exc))
        if json_requested(sys.argv[1:]):
            wait = getattr(exc, "wait_seconds", None)
            extra: dict[str, object] = {"wait_seconds": round(wait, 3)} if wait is not None else {}
            if getattr(exc, "waits", None) is not None:
                extra["waits"] = exc.waits  # type: ignore[attr-defined]
            print_json_error(str(exc), exc.exit_code, **extra)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        error("interrupted")
        sys.exit(130)
    except MemoryError:
        error(OUT_OF_MEMORY)
        sys.exit(1)
    except Exception as exc:  # the CLI's one catch-all: a line, never a traceback
        # Click (or Typer's bundled Click) usage errors: duck-typed so either flavour is caught.
        if type(exc).__name__ == "Abort":
            error("aborted")
            sys.exit(1)
        exit_code: object = getattr(exc, "exit_code", None)
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: its help, as Click prints it (exit 2)
            sys.stderr.write(f"{exc.format_message()}\n")  # type: ignore[attr-defined]
            sys.exit(2)
        if hasattr(exc, "format_message") and isinstance(exit_code, int):
            ctx = getattr(exc, "ctx", None)
            where = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
            error(f"{exc.format_message()}{where}")
            sys.exit(exit_code)
        if os.environ.get("MRTR_KEYS_DEBUG"):
            raise
        error(scrub(f"internal error: {type(exc).__name__}: {exc}"))
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    run()
