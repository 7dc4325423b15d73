"""The everyday CLI conveniences (deliverable 3), as a user sees them: text and ``--json``.

Vault and Tinkey users reach for these daily: ``--version``, ``inspect -`` (the token stays out
of the shell history), 80-column tables, ``keys show``, ``keys destroy`` (Vault ``trim``, Tinkey
``destroy-key``), ``rotate abort``, scheduled ``rotate next --if-older-than``, ``keys ttl``.
Commands run in this process through the console script's `run()` (tests.fixtures.audit.cli),
except where standard input or a fresh terminal width matters (a subprocess).
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest

from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import utcnow
from tests.fixtures.audit import cli
from tests.fixtures.common import MRTR_KEYS, CliResult


def ok(r: CliResult) -> CliResult:
    assert r.code == 0, (r.code, r.out, r.err)
    assert "Traceback" not in r.err
    return r


def refused(r: CliResult, code: int, *fragments: str) -> None:
    assert r.code == code, (r.code, r.out, r.err)
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.err, r.err
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture
def ring(tmp_path: Path) -> Path:
    path = tmp_path / "keyring.json"
    ok(cli("init", "--audience", "billing", keystore=path))
    return path


def rotated(path: Path) -> tuple[str, str]:
    """One full rotation (retire forced: no TTL wait in a unit test); returns (old kid, new kid)."""
    store = FileKeystore(path)
    old = store.load().primary.kid
    run_step(store, "begin")
    run_step(store, "promote")
    run_step(store, "retire", force=True)
    return old, store.load().primary.kid


def test_version_prints_the_package_version() -> None:
    from importlib.metadata import version

    assert ok(cli("--version")).out == f"mrtr-keys {version('mrtr-keys')}\n"
    info = ok(cli("version", "--json")).json()
    assert info["mrtr_keys"] == version("mrtr-keys") and info["mcp"] == version("mcp")


def test_inspect_reads_the_token_from_stdin(ring: Path) -> None:
    """`inspect -`: the token comes from standard input (never the command line, so never the history)."""
    token = LocalAESGCMCodec(ring, audience="billing").seal(b"x")
    env = {**os.environ, "MRTR_KEYS_KEYSTORE": str(ring)}
    run = subprocess.run(
        [*MRTR_KEYS, "inspect", "-", "--json"], input=token + "\n", capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout)
    assert info["kid"] == FileKeystore(ring).load().primary.kid and info["state"] == "primary"
    empty = subprocess.run([*MRTR_KEYS, "inspect", "-"], input="", capture_output=True, text=True, env=env)
    assert (
        empty.returncode == 2 and empty.stderr == "mrtr-keys: inspect -: standard input must hold exactly one token\n"
    )


def test_inspect_reads_a_long_token_from_stdin_whole(ring: Path) -> None:
    """`inspect -` read only the first 1 MiB of standard input, so a token of 1 to 4 MiB (which every codec
    accepts, docs/token-format.md "Limits") was cut and described as another, shorter token; more than any
    token is one line and exit 2, not a description of its first part."""
    from mrtr_keys.token import MAX_TOKEN_CHARS

    token = LocalAESGCMCodec(ring, audience="billing").seal(b"x" * (3 << 19))  # 1.5 MiB: a 2 MiB token
    env = {**os.environ, "MRTR_KEYS_KEYSTORE": str(ring)}
    run = subprocess.run(
        [*MRTR_KEYS, "inspect", "-", "--json"], input=token + "\n", capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout)
    assert info["token_chars"] == len(token) == 2_097_199 and info["ciphertext_bytes"] == 3 << 19
    over = subprocess.run(
        [*MRTR_KEYS, "inspect", "-"], input="mk2." + "A" * (MAX_TOKEN_CHARS + 8192), capture_output=True, text=True
    )
    assert over.returncode == 2 and over.stderr == (
        "mrtr-keys: inspect -: standard input holds more than 4,198,400 characters, longer than any token "
        "(4,194,304 characters at most)\n"
    )


def test_keys_list_fits_80_columns_and_wide_shows_every_column(ring: Path) -> None:
    old, new = rotated(ring)
    ok(cli("keys", "destroy", old, keystore=ring))
    os.environ["COLUMNS"] = "80"  # cli() restores the environment
    text = ok(cli("keys", "list", keystore=ring)).out
    del os.environ["COLUMNS"]
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    assert lines[0].startswith("key ring r-") and "generation 5" in lines[0]
    assert lines[1].split() == ["kid", "state", "created", "(UTC)", "promoted", "(UTC)", "retired", "(UTC)", "used"]
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert rows[old][1] == "destroyed" and rows[new][1] == "primary"
    assert rows[new][-2] == "-"  # not retired; times to the minute, "2026-12-01 15:04"
    assert rows[new][-1] == "0.0%"  # of its seal budget, fleet-wide (issue 36)
    wide = ok(cli("keys", "list", "--wide", keystore=ring)).out
    for col in ("demoted_at", "destroyed_at"):
        assert col in wide
    assert max(len(line) for line in wide.splitlines()) > 80
    doc = ok(cli("keys", "list", "--json", keystore=ring)).json()
    assert [k["kid"] for k in doc["keys"]] == [old, new] and doc["keys"][0]["destroyed_at"]


def test_keys_show_one_key(ring: Path) -> None:
    kid = FileKeystore(ring).load().primary.kid
    info = ok(cli("keys", "show", kid, "--json", keystore=ring)).json()
    assert info["kid"] == kid and info["state"] == "primary" and info["sealing"] and info["opening"]
    assert info["material"] == "held" and "material" not in json.dumps(
        {k: v for k, v in info.items() if k != "material"}
    )
    text = ok(cli("keys", "show", kid, keystore=ring)).out
    assert f"key {kid}" in text and "primary" in text
    refused(cli("keys", "show", "00000000", keystore=ring), 2, "no key 00000000", "mrtr-keys keys list")


def test_keys_destroy_removes_material_keeps_the_record_and_only_for_retired_keys(ring: Path) -> None:
    """Vault `trim` / Tinkey `destroy-key`: a retired key's material leaves the ring; codecs still
    treat it as retired (a token under it is rejected the same way before and after)."""
    codec = LocalAESGCMCodec(ring, audience="billing")
    old_token = codec.seal(b"sealed under the old key")
    old, new = rotated(ring)
    refused(cli("keys", "destroy", new, keystore=ring), 1, f"{new} is primary", "rotate first")
    run_step(FileKeystore(ring), "begin")
    verify = next(k.kid for k in FileKeystore(ring).load().keys if k.state.value == "verify")
    refused(cli("keys", "destroy", verify, keystore=ring), 1, f"{verify} is verify", "finish the rotation")
    out = ok(cli("keys", "destroy", old, "--json", keystore=ring)).json()
    assert out["changed"] is True and out["kid"] == old
    doc = json.loads(ring.read_text())
    entry = next(k for k in doc["keys"] if k["kid"] == old)
    assert entry["state"] == "retired" and entry["destroyed_at"] and "material" not in entry
    again = ok(cli("keys", "destroy", old, keystore=ring)).out
    assert again.startswith(f"key {old} was already destroyed at ")
    from mcp.server.mcpserver import InvalidRequestState

    with pytest.raises(InvalidRequestState, match="retired"):
        LocalAESGCMCodec(ring, audience="billing").unseal(old_token)


def test_rotate_abort_undoes_begin_and_is_refused_after_promote(ring: Path) -> None:
    store = FileKeystore(ring)
    primary = store.load().primary.kid
    new = ok(cli("rotate", "begin", "--json", keystore=ring)).json()["new"]
    out = ok(cli("rotate", "abort", "--json", keystore=ring)).json()
    assert out["changed"] and out["removed"] == new and out["primary"] == primary
    assert [k.kid for k in store.load().keys] == [primary]
    assert ok(cli("rotate", "abort", keystore=ring)).out == "no rotation in progress; nothing to abort\n"
    ok(cli("rotate", "begin", keystore=ring))
    ok(cli("rotate", "promote", keystore=ring))
    refused(cli("rotate", "abort", keystore=ring), 1, "cannot abort after promote", "mrtr-keys rotate retire")


def test_rotate_next_if_older_than_is_a_noop_while_the_primary_is_younger(ring: Path) -> None:
    store = FileKeystore(ring)
    generation = store.load().generation
    r = ok(cli("rotate", "next", "--if-older-than", "30d", keystore=ring))
    assert r.out.startswith("nothing to do: primary ") and "younger than 30d" in r.out
    doc = ok(cli("rotate", "next", "--if-older-than", "30d", "--json", keystore=ring)).json()
    assert doc["changed"] is False and doc["step"] == "next" and doc["due_at"]
    assert store.load().generation == generation
    # A primary promoted 31 days ago: the scheduled run begins a rotation.
    from dataclasses import replace

    ring_now = store.load()
    aged = replace(ring_now.primary, promoted_at=utcnow() - timedelta(days=31))
    store.save(ring_now.next_generation(keys=(aged,)), expected_generation=ring_now.generation)
    began = ok(cli("rotate", "next", "--if-older-than", "30d", "--json", keystore=ring)).json()
    assert began["step"] == "begin" and began["changed"] is True
    refused(cli("rotate", "next", "--if-older-than", "soon", keystore=ring), 2, "--if-older-than must be a duration")


def test_keys_ttl_raises_at_once_and_lowers_in_two_steps(ring: Path) -> None:
    assert ok(cli("keys", "ttl", "--json", keystore=ring)).json()["ttl_seconds"] == 600.0
    assert ok(cli("keys", "ttl", "15m", keystore=ring)).out == "TTL raised to 900 s, in force now\n"
    first = ok(cli("keys", "ttl", "300", "--json", keystore=ring)).json()
    assert first["ttl_seconds"] == 900.0 and first["pending_ttl_seconds"] == 300.0 and first["ready_at"]
    refused(cli("keys", "ttl", "300", keystore=ring), 75, "waiting", "+ 900 s + 60 s")
    # A server starting now is held to the pending lower TTL.
    import mrtr_keys
    from mrtr_keys.errors import ConfigError

    with pytest.raises(ConfigError, match="longer than the key ring's TTL"):
        mrtr_keys.request_state_security(str(ring), audience="billing", ttl=600)
    assert (
        ok(cli("keys", "ttl", "900", keystore=ring)).out
        == "TTL kept at 900 s, in force now (the pending lowering is cancelled)\n"
    )


def test_clients_add_without_a_ring_refuses_with_a_hint(tmp_path: Path) -> None:
    r = cli("clients", "add", "web", "--audience", "billing", keystore=tmp_path / "none" / "keyring.json")
    refused(r, 2, "no key ring at file://", "--keystore", "mrtr-keys init")
    assert not (tmp_path / "none").exists()


def test_audit_tail_fits_80_columns_and_wide_shows_every_field(ring: Path, make_sink) -> None:
    from mrtr_keys.audit.events import FIELDS
    from tests.fixtures.audit import insert, known_events

    sink = make_sink(f"sqlite:///{ring.parent}/audit.db")
    insert(sink, known_events(6))
    sink.flush()
    os.environ["COLUMNS"] = "80"
    text = ok(cli("audit", "tail", "-n", "6", keystore=ring)).out
    del os.environ["COLUMNS"]
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    assert lines[1].split() == ["time", "(UTC)", "op", "kid", "audience", "result", "client"]
    last = lines[-1].split()
    # known_events(6)[5]: 10:00:05, unseal, bbbbbbbb, orders, rejected (expired), client web
    assert last == ["07-28", "10:00:05", "unseal", "bbbbbbbb", "orders", "expired", "web"], lines[-1]
    wide = ok(cli("audit", "tail", "-n", "6", "--wide", keystore=ring)).out
    assert all(f in wide for f in FIELDS) and "host-1:1001" in wide
    events = ok(cli("audit", "tail", "-n", "6", "--json", keystore=ring)).json()
    assert [e["time"][17:19] for e in events[-2:]] == ["04", "05"]


def test_shell_completion_script_and_completions() -> None:
    """docs/cli.md: `mrtr-keys --show-completion`, run from bash, prints bash's script (the shell is detected
    from the parent process, so the command runs under a bash that stays its parent); bash then asks the CLI."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("_MRTR")}
    from_bash = ["bash", "-c", '"$@"; exit $?', "bash", *MRTR_KEYS, "--show-completion"]
    script = subprocess.run(from_bash, capture_output=True, text=True, env=env)
    assert script.returncode == 0 and "complete -o default -F _mrtr_keys_completion mrtr-keys" in script.stdout
    words = {**env, "COMP_WORDS": "mrtr-keys keys d", "COMP_CWORD": "2", "_MRTR_KEYS_COMPLETE": "complete_bash"}
    done = subprocess.run(MRTR_KEYS, capture_output=True, text=True, env=words)
    assert done.stdout.split() == ["destroy"]


def test_audit_tables_show_control_characters_escaped_so_a_stored_value_cannot_drive_the_terminal(
    ring: Path, make_sink
) -> None:
    """A sidecar client chooses the audience of a refused call, and the audit log keeps it as sent: ``audit tail``
    and ``audit query`` printed it raw, so ``ESC[1A ESC[2K`` (cursor up, erase line) hid the row above from the
    operator and a newline forged a row of its own. Every table cell and followed line now shows control
    characters escaped (``\\x1b``, ``\\n``), as error messages already did."""
    from dataclasses import replace

    from tests.fixtures.audit import insert, known_events

    sink = make_sink(f"sqlite:///{ring.parent}/audit.db")
    hostile = "\x1b[1A\x1b[2K\nforged"
    insert(sink, [replace(e, audience=hostile, client="c\x1b]0;x\x07") for e in known_events(2)])
    sink.flush()
    for args in (("tail", "-n", "2"), ("tail", "-n", "2", "--wide"), ("query", "--limit", "2")):
        out = ok(cli("audit", *args, keystore=ring)).out
        assert "\x1b" not in out and "\x07" not in out, (args, out)
        assert not any(line.strip().startswith("forged") for line in out.splitlines()), (args, out)
        assert "\\x1b[1A" in out, (args, out)
    wide = ok(cli("audit", "tail", "-n", "2", "--wide", keystore=ring)).out
    assert "\\x1b[1A\\x1b[2K\\nforged" in wide
