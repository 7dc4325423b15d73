"""`mrtr-keys` as a deploy pipeline runs it (deliverable 6): a subprocess per command,
`--json` parsed, exit codes 0 done / 75 not yet / 2 usage or configuration / 1 anything else,
one line on stderr for every refusal and never a traceback (cli/main.py)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from mrtr_keys.changes import scope as audience
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import format_time, parse_time
from tests.fixtures.common import MRTR_KEYS, CliResult, run_cli
from tests.fixtures.keyrings import BadRing, bad_rings, write_ring_doc

BAD = bad_rings()


def refused(r: CliResult, code: int, *fragments: str) -> str:
    """Assert a one-line refusal with `code` on stderr containing every fragment; returns the line."""
    assert r.code == code, (r.code, r.out, r.err)
    assert "Traceback" not in r.err + r.out
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def ok(r: CliResult) -> CliResult:
    assert r.code == 0, (r.code, r.out, r.err)
    assert r.err == ""
    return r


def parallel(*calls: tuple[str, ...], keystore: Path | None = None) -> list[CliResult]:
    """Run independent CLI calls at once (each its own process); results in order."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda args: run_cli(*args, keystore=keystore), calls))


def materials(path: Path) -> list[str]:
    return [base64.b64encode(k.material).decode() for k in FileKeystore(path).load().keys if k.material]


def envelope_token(path: Path, audience: str, *, ttl: float = 600.0, iat: float | None = None) -> tuple[str, str]:
    """A token sealing an MCP SDK envelope (the claims `RequestStateBoundary._seal` writes)."""
    from mcp.server.request_state import compact_json

    iat = time.time() if iat is None else iat
    inner = "INNER-STATE-" + os.urandom(4).hex()
    claims = {"v": 1, "iat": iat, "exp": iat + ttl, "m": "tools/call", "t": "book_flight", "a": "abc", "s": inner}
    claims["aud"] = audience
    return LocalAESGCMCodec(path, audience=audience).seal(compact_json(claims).encode()), inner


# init


def test_init_creates_a_0600_ring_and_prints_its_kid(tmp_path: Path) -> None:
    path = tmp_path / "ring.json"
    out = ok(run_cli("init", "--ttl", "30", "--audience", "billing", "--json", keystore=path)).json()
    ring = FileKeystore(path).load()
    assert out["kid"] == ring.primary.kid and len(out["kid"]) == 8
    assert out["generation"] == 1 and out["ttl_seconds"] == 30.0 and out["audiences"] == ["billing"]
    assert out["codec"] == "local" and out["keystore"] == path.as_uri()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    human = ok(run_cli("init", keystore=tmp_path / "other.json"))
    assert "primary key: " in human.out
    for material in materials(path) + materials(tmp_path / "other.json"):
        assert material not in out.__repr__() + human.out


def test_init_twice_exits_1_and_leaves_the_ring_untouched(keystore_path: Path) -> None:
    before = keystore_path.read_bytes()
    refused(run_cli("init", keystore=keystore_path), 1, "already exists", "never overwritten")
    assert keystore_path.read_bytes() == before


def test_the_keystore_option_takes_a_file_url_and_beats_the_environment(tmp_path: Path, keystore_path: Path) -> None:
    elsewhere = tmp_path / "missing.json"
    out = ok(run_cli("keys", "list", "--json", "--keystore", keystore_path.as_uri(), keystore=elsewhere)).json()
    assert out["generation"] == 1


# keys list, rotate status


def test_keys_list_shows_kids_states_and_times_never_material(keystore: FileKeystore) -> None:
    run_step(keystore, "begin")
    as_json, table = parallel(("keys", "list", "--json"), ("keys", "list"), keystore=keystore.path)
    data = ok(as_json).json()
    ring = keystore.load()
    assert data["generation"] == 2 and data["codec"] == "local"
    assert [(k["kid"], k["state"]) for k in data["keys"]] == [(k.kid, k.state.value) for k in ring.keys]
    times = {"created_at", "promoted_at", "demoted_at", "retired_at"}
    counts = {"seals", "unseals", "rejections", "budget", "used"}  # issue 36: fleet-wide, against the budget
    assert set(data["keys"][0]) == {"kid", "state", "format", *times, *counts}
    # No instance has reported to this ring's (not yet written) audit store: the counts are unknown, and said so.
    assert data["seal_counts"] is None and data["keys"][0]["seals"] is None and data["keys"][0]["budget"] == 2**47
    assert "no presence store" in data["seal_counts_note"] and "no presence store" in ok(table).out
    assert ring.primary.kid in ok(table).out
    for material in materials(keystore.path):
        assert material not in as_json.out + table.out


def test_keys_list_and_show_work_while_the_presence_store_is_down(keystore: FileKeystore) -> None:
    """The seal counts come from the audit store; one that could not be reached made `keys list`, `keys show` and
    `keys budget` exit 75 without showing the ring, the keys an operator looks up to revoke one during an outage.
    They show the keys, and one line says why the counts are missing (as for a store that cannot be read)."""
    down = {"MRTR_KEYS_AUDIT": "postgresql://mrtr@127.0.0.1:1/mrtr"}  # port 1: connection refused
    kid = keystore.load().primary.kid
    listed = ok(run_cli("keys", "list", "--json", keystore=keystore.path, env=down)).json()
    assert [k["kid"] for k in listed["keys"]] == [kid] and listed["keys"][0]["seals"] is None
    assert listed["seal_counts"] is None and listed["seal_counts_note"].startswith(
        "seal counts unavailable: cannot connect to the audit store postgresql://mrtr@127.0.0.1:1/mrtr"
    )
    table = ok(run_cli("keys", "list", keystore=keystore.path, env=down)).out
    assert kid in table and "seal counts unavailable: cannot connect" in table
    shown = ok(run_cli("keys", "show", kid, "--json", keystore=keystore.path, env=down)).json()
    assert shown["state"] == "primary" and shown["seals"] is None and "cannot connect" in shown["seal_counts_note"]
    budgets = ok(run_cli("keys", "budget", "--json", keystore=keystore.path, env=down)).json()
    assert budgets["keys"][0]["kid"] == kid and budgets["keys"][0]["seals"] is None


def test_rotate_status_reports_the_phase_the_next_step_and_the_wait(keystore: FileKeystore) -> None:
    idle = ok(run_cli("rotate", "status", "--json", keystore=keystore.path)).json()
    assert idle["phase"] == "idle" and idle["next_step"] == "begin" and idle["generation"] == 1
    run_step(keystore, "begin")
    run_step(keystore, "promote")
    as_json, human = parallel(("rotate", "status", "--json"), ("rotate", "status"), keystore=keystore.path)
    promoted = ok(as_json).json()
    assert promoted["phase"] == "promoted" and promoted["phase_number"] == 2 and promoted["next_step"] == "retire"
    assert 600 < promoted["wait_seconds"] <= 660 and promoted["retire_at"].endswith("Z")
    assert promoted["primary"] == promoted["new"] != promoted["old"]
    assert "retire" in ok(human).out and promoted["retire_at"] in human.out


# rotation: every step, every refusal, every rerun


def test_a_whole_rotation_with_every_refusal_and_rerun(keystore_path: Path) -> None:
    """Each phase, then (at once) every rerun and refusal that phase allows; refusals write nothing."""
    ks = keystore_path
    old = FileKeystore(ks).load().primary.kid

    promote, retire = parallel(("rotate", "promote"), ("rotate", "retire"), keystore=ks)
    refused(promote, 1, "nothing to promote", "run: mrtr-keys rotate begin")
    refused(retire, 1, "nothing to retire", "run: mrtr-keys rotate begin")

    begun = ok(run_cli("rotate", "begin", "--json", keystore=ks)).json()
    new = begun["new"]
    assert begun["changed"] is True and begun["step"] == "begin" and begun["old"] == old and begun["generation"] == 2
    again, retire = parallel(("rotate", "begin", "--json"), ("rotate", "retire"), keystore=ks)
    assert ok(again).json()["changed"] is False and "already begun" in again.json()["message"]
    assert again.json()["generation"] == 2 and len(FileKeystore(ks).load().keys) == 2, "a rerun adds no key"
    refused(retire, 1, "not sealing yet", "run: mrtr-keys rotate promote")

    promoted = ok(run_cli("rotate", "promote", "--json", keystore=ks)).json()
    assert promoted["changed"] is True and promoted["new"] == new and promoted["generation"] == 3
    rerun, begin, early, nxt = parallel(
        ("rotate", "promote"), ("rotate", "begin"), ("rotate", "retire"), ("rotate", "next", "--json"), keystore=ks
    )
    assert "already promoted" in ok(rerun).out
    refused(begin, 1, f"{old} is not yet retired", "run: mrtr-keys rotate retire")
    line = refused(early, 75, f"retiring {old} now would reject tokens still in flight", "TTL 600 s + 60 s")
    assert 600 < int(line.split("waiting ")[1].split(" s")[0]) <= 660
    refused(nxt, 75, "waiting")
    assert nxt.json()["exit_code"] == 75 and 600 < nxt.json()["wait_seconds"] <= 660  # --json: an error object
    assert FileKeystore(ks).load().generation == 3, "a refused step writes nothing"

    forced = ok(run_cli("rotate", "retire", "--force", "--json", keystore=ks)).json()
    assert forced["changed"] is True and forced["forced"] is True and forced["old"] == old
    assert "before the TTL gate" in forced["message"] and f"tokens sealed with {old}" in forced["message"]
    assert "now rejected" in forced["message"]
    rerun = ok(run_cli("rotate", "retire", "--json", keystore=ks)).json()
    assert rerun["changed"] is False and "already retired" in rerun["message"]
    states = {k.kid: k.state.value for k in FileKeystore(ks).load().keys}
    assert states == {old: "retired", new: "primary"}


def test_next_performs_begin_then_promote(keystore_path: Path) -> None:
    first = ok(run_cli("rotate", "next", "--json", keystore=keystore_path)).json()
    second = ok(run_cli("rotate", "next", "--json", keystore=keystore_path)).json()
    assert (first["step"], second["step"]) == ("begin", "promote")
    assert second["generation"] == 3


def _age_promotion(path: Path, seconds: float) -> None:
    """Move the promote (and demote) times back by `seconds`, as if that much time had passed (keeps 0600)."""
    doc = json.loads(path.read_text())
    for key in doc["keys"]:
        for field in ("promoted_at", "demoted_at"):
            t = parse_time(key.get(field), field)
            if t is not None and key["state"] != "retired":
                key[field] = format_time(t - timedelta(seconds=seconds))
    write_ring_doc(path, doc)


def test_the_ttl_gate_is_ttl_plus_60_s_and_stored_in_the_ring(keystore_path: Path) -> None:
    """`rotate begin --ttl 1` stores 1 s; retire then waits 1 + 60 s after the promote; once that time
    has passed (the promote time moved back in the file) `next` retires without --force."""
    ks = keystore_path
    ok(run_cli("rotate", "begin", "--ttl", "1", keystore=ks))
    assert FileKeystore(ks).load().ttl_seconds == 1.0
    ok(run_cli("rotate", "promote", keystore=ks))
    line = refused(run_cli("rotate", "retire", keystore=ks), 75, "TTL 1 s + 60 s")
    assert int(line.split("waiting ")[1].split(" s")[0]) in range(50, 62)
    _age_promotion(ks, 62)
    done = ok(run_cli("rotate", "next", "--json", keystore=ks)).json()
    assert done["step"] == "retire" and done["changed"] is True and done["forced"] is False


def test_four_begins_at_the_same_moment_add_exactly_one_key(keystore_path: Path) -> None:
    """Concurrent CLI runs can never both win; the file stays valid."""
    env = {**os.environ, "MRTR_KEYS_KEYSTORE": str(keystore_path)}
    procs = [
        subprocess.Popen(
            [*MRTR_KEYS, "rotate", "begin", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(4)
    ]
    results = [CliResult(p.wait(timeout=60), p.stdout.read(), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    for p in procs:
        p.stdout.close()  # type: ignore[union-attr]
        p.stderr.close()  # type: ignore[union-attr]
    changed = []
    for r in results:
        if r.code == 0:
            changed.append(r.json()["changed"])
        else:
            refused(r, 1, "changed while this run was working")
    assert changed.count(True) == 1
    ring = FileKeystore(keystore_path).load()
    assert ring.generation == 2 and len(ring.keys) == 2
    assert sorted(k.state.value for k in ring.keys) == ["primary", "verify"]


# audience


def test_audience_list_add_remove(keystore_path: Path) -> None:
    ks = keystore_path
    empty = ok(run_cli("audience", "list", "--json", keystore=ks)).json()
    assert empty == {"audiences": [], "any": True, "generation": 1}
    added = ok(run_cli("audience", "add", "billing", "--json", keystore=ks)).json()
    assert added["changed"] is True and added["audiences"] == ["billing"] and added["generation"] == 2
    again, listed, human = parallel(
        ("audience", "add", "billing", "--json"), ("audience", "list", "--json"), ("audience", "list"), keystore=ks
    )
    assert ok(again).json()["changed"] is False
    assert ok(listed).json() == {"audiences": ["billing"], "any": False, "generation": 2}
    assert ok(human).out == "billing\n"
    last = run_cli("audience", "remove", "billing", "--json", keystore=ks)
    refused(last, 2, "--allow-any")
    assert last.json()["exit_code"] == 2 and "ANY audience" in last.json()["error"]  # --json: an error object
    removed = ok(run_cli("audience", "remove", "billing", "--allow-any", "--json", keystore=ks)).json()
    assert removed["audiences"] == [] and "allows any audience" in removed["message"]
    refused(run_cli("audience", "add", " spaced", keystore=ks), 2, "printable")


def test_a_codec_outside_the_scope_is_a_configuration_error(keystore_path: Path) -> None:
    audience.add(FileKeystore(keystore_path), "billing")
    token = LocalAESGCMCodec(keystore_path, audience="billing").seal(b"{}")
    r = run_cli("inspect", "--decrypt", "--audience", "Billing", token, keystore=keystore_path)
    refused(r, 2, "'Billing' is outside this key ring's scope (billing)", "mrtr-keys audience add Billing")


# inspect


def test_inspect_without_decrypting(keystore: FileKeystore) -> None:
    token = LocalAESGCMCodec(keystore, audience="billing").seal(b"x" * 300)
    as_json, table = parallel(("inspect", token, "--json"), ("inspect", token), keystore=keystore.path)
    info = ok(as_json).json()
    assert info == {
        "format": "mk2",
        "kid": keystore.load().primary.kid,
        "state": "primary",
        "key_format": "mk2",
        "token_chars": len(token),
        "nonce_bytes": 12,
        "ciphertext_bytes": 300,
        "tag_bytes": 16,
    }
    assert "mk2" in ok(table).out and info["kid"] in table.out


def test_inspect_names_the_state_of_a_retired_kid(keystore: FileKeystore) -> None:
    token = LocalAESGCMCodec(keystore, audience="billing").seal(b"{}")
    for step in ("begin", "promote"):
        run_step(keystore, step)
    run_step(keystore, "retire", force=True)
    assert ok(run_cli("inspect", token, "--json", keystore=keystore.path)).json()["state"] == "retired"


def test_inspect_decrypt_shows_the_sdk_envelope_but_not_the_inner_state(keystore: FileKeystore) -> None:
    """Method, target, audience, issued and expiry times (UTC), expired; `s` only with --show-state."""
    iat = 1_790_000_000.0  # 2026-09-21T14:13:20Z, a fixed time
    fresh, inner = envelope_token(keystore.path, "billing", iat=time.time())
    old, old_inner = envelope_token(keystore.path, "billing", iat=iat, ttl=600)
    base = ("inspect", "--decrypt", "--audience", "billing")
    hidden, shown, human = parallel(
        (*base, "--json", fresh), (*base, "--json", "--show-state", old), (*base, fresh), keystore=keystore.path
    )
    info = ok(hidden).json()
    assert info["decrypted"] is True and info["kid"] == keystore.load().primary.kid
    assert (info["method"], info["target"], info["audience"]) == ("tools/call", "book_flight", "billing")
    assert info["expired"] is False and info["issued_at"].endswith("Z") and info["expires_at"].endswith("Z")
    assert inner not in hidden.out and "inner_state" not in info
    assert inner not in ok(human).out and "book_flight" in human.out
    old_info = ok(shown).json()
    assert old_info["inner_state"] == old_inner
    assert old_info["state"] == "primary", "the kid's state is still there"
    assert old_info["expired"] is True
    assert (old_info["issued_at"], old_info["expires_at"]) == ("2026-09-21T14:13:20Z", "2026-09-21T14:23:20Z")


def test_inspect_decrypt_for_the_wrong_audience_does_not_unseal(keystore: FileKeystore) -> None:
    token, inner = envelope_token(keystore.path, "billing")
    r = run_cli("inspect", "--decrypt", "--audience", "payments", token, keystore=keystore.path)
    refused(r, 1, "does not unseal for audience 'payments'")
    assert inner not in r.out + r.err


def test_inspect_decrypt_of_a_payload_nested_too_deep_for_the_parser_is_not_an_envelope(keystore: FileKeystore) -> None:
    """A sidecar client seals any payload; one JSON value nested 10,000 deep made `inspect --decrypt` end in
    ``internal error: RecursionError``. It is shown as what it is: not an MCP SDK envelope."""
    deep = b"[" * 10_000 + b"]" * 10_000
    token = LocalAESGCMCodec(keystore, audience="billing").seal(deep)
    r = run_cli("inspect", "--decrypt", "--audience", "billing", "--json", token, keystore=keystore.path)
    info = ok(r).json()
    assert (info["envelope"], info["payload_bytes"]) == ("not an MCP SDK envelope", len(deep))


def test_inspect_of_garbage_exits_1_not_a_valid_token(keystore_path: Path) -> None:
    garbage = ("garbage", "mk1.!!!", "mk1.a b", "mk1.AAAA", "v1." + "A" * 48)
    results = parallel(*(("inspect", g) for g in garbage), keystore=keystore_path)
    for r in results:
        refused(r, 1, "not a valid token")
    for r in results[1:4]:
        refused(r, 1, "does not parse")


# usage, configuration and bad rings


def test_usage_errors_exit_2_with_one_line(keystore_path: Path) -> None:
    results = parallel(
        ("rotate", "bogus"),
        ("init", "--ttl", "abc"),
        ("audience", "add"),
        ("keys", "list", "--no-such-option"),
        ("inspect",),
        keystore=keystore_path,
    )
    for r in results:
        refused(r, 2, "mrtr-keys")
    refused(results[0], 2, "No such command 'bogus'", "mrtr-keys rotate --help")


def test_a_bare_group_prints_its_help(keystore_path: Path) -> None:
    r = run_cli("rotate", keystore=keystore_path)
    assert r.code == 2 and "Traceback" not in r.err
    assert r.err.startswith("Usage: mrtr-keys rotate") and "promote" in r.err


def test_a_missing_ring_exits_2_naming_init(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.json"
    for r in parallel(("keys", "list"), ("rotate", "begin"), keystore=missing):
        refused(r, 2, "no key ring at", "mrtr-keys init")
    assert not missing.exists()


def test_bad_rings_are_one_line_errors_without_material(tmp_path: Path) -> None:
    """Every bad ring of tests/fixtures/keyrings.py through the CLI (`keys list`; `rotate begin` for two): exit 1, one
    line, no material, and the file is never rewritten."""
    calls = []
    for i, bad in enumerate(BAD):
        path = write_ring_doc(tmp_path / f"{i}.json", bad.doc, mode=bad.mode)
        calls.append((bad, path, ("rotate", "begin") if i in (0, len(BAD) - 1) else ("keys", "list")))

    def run(call: tuple[BadRing, Path, tuple[str, ...]]) -> tuple[BadRing, Path, CliResult]:
        bad, path, args = call
        return bad, path, run_cli(*args, keystore=path)

    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(run, calls))
    for bad, path, r in outcomes:
        refused(r, 1, bad.expect)
        for material in bad.material:
            assert material not in r.err + r.out
        assert json.loads(path.read_text()) == bad.doc, "a refused command never rewrites the ring"


def test_ttl_bounds_and_a_ttl_change_mid_rotation_are_refused(tmp_path: Path) -> None:
    """Our decision: a TTL is 0 < ttl <= 30 days (the retire gate must stay a printable date), set at init or
    at a begin; a different --ttl on a rerun of begin is refused rather than silently ignored."""
    ks = tmp_path / "keyring.json"
    for bad in ("0", "-5", "1e12", "nan", "inf"):
        refused(run_cli("init", "--ttl", bad, keystore=ks), 2, "--ttl")
    assert not ks.exists()
    ok(run_cli("init", "--ttl", "120", keystore=ks))
    ok(run_cli("rotate", "begin", keystore=ks))
    refused(run_cli("rotate", "begin", "--ttl", "900", keystore=ks), 1, "already begun with TTL 120 s")
    assert "already begun" in ok(run_cli("rotate", "begin", "--ttl", "120", keystore=ks)).out
