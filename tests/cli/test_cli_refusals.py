"""Refusals a new user met in a trial run: each is one line on stderr and exit 2, never a traceback or exit 3."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from mrtr_keys.errors import ConfigError
from tests.fixtures.common import CliResult, run_cli


def one_line(r: CliResult, code: int, fragment: str) -> None:
    assert r.code == code, (r.code, r.out, r.err)
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1, r.err
    assert fragment in r.err, r.err


def test_serve_on_a_port_in_use_is_a_one_line_configuration_error(keystore_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        one_line(run_cli("serve", "--port", str(port), keystore=keystore_path), 2, f"cannot listen on 127.0.0.1:{port}")


def test_a_client_grant_outside_the_ring_scope_is_refused(keystore_path: Path) -> None:
    assert run_cli("audience", "add", "billing", keystore=keystore_path).code == 0
    one_line(run_cli("clients", "add", "app", "--audience", "other", keystore=keystore_path), 2, "outside")
    listed = run_cli("clients", "list", "--json", keystore=keystore_path)
    assert listed.code == 0 and listed.json()["clients"] == []


def test_audit_query_filters_and_times_are_checked(keystore_path: Path, tmp_path: Path) -> None:
    assert run_cli("rotate", "begin", keystore=keystore_path).code == 0  # the CLI records it: the log exists
    one_line(run_cli("audit", "query", "--since", "99999999h", keystore=keystore_path), 2, "shorter duration")
    one_line(run_cli("audit", "query", "--op", "bogus", keystore=keystore_path), 2, "--op must be one of")
    one_line(run_cli("audit", "query", "--outcome", "maybe", keystore=keystore_path), 2, "--outcome must be")
    target = tmp_path / "missing" / "x.jsonl"
    one_line(run_cli("audit", "export", "-o", str(target), keystore=keystore_path), 2, "cannot write")


def test_a_nul_byte_in_a_keystore_or_audit_url_is_one_line_not_an_internal_error(keystore_path: Path) -> None:
    """``%00`` decodes to a byte no file name can hold: a one-line refusal, exit 2, not ``ValueError``."""
    one_line(run_cli("keys", "list", "--keystore", f"file://{keystore_path}%00"), 2, "keystore location cannot contain")
    for url in ("sqlite:///tmp/a%00b.db", "jsonl:///tmp/a%00b.jsonl"):
        one_line(run_cli("audit", "query", "--audit", url, keystore=keystore_path), 2, "audit store URL cannot contain")


def test_an_unknown_audit_store_url_is_refused_without_its_password(keystore_path: Path) -> None:
    r = run_cli("audit", "query", "--audit", "redis://:S3cretPW@127.0.0.1:6379/0", keystore=keystore_path)
    one_line(r, 2, "unknown audit store 'redis://:***@127.0.0.1:6379/0'")
    assert "S3cretPW" not in r.out + r.err


def test_health_never_prints_a_password_from_the_sidecar_url() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = closed.getsockname()[1]
        r = run_cli("health", "--url", f"http://ops:S3cretPW@127.0.0.1:{port}")
    assert r.code == 1, (r.code, r.err)
    assert (
        r.err.strip() == f"mrtr-keys: sidecar at http://ops:***@127.0.0.1:{port} did not answer /healthz: ConnectError"
    )
    assert "S3cretPW" not in r.out + r.err


def test_a_state_directory_given_as_a_url_is_refused_and_creates_nothing(keystore_path: Path, tmp_path: Path) -> None:
    """``file:///x`` is not a path: taken literally it would create a directory named ``file:``."""
    message = "the state directory is a local directory path, not 'file:///tmp/x' (--state-dir or MRTR_KEYS_STATE_DIR)"
    one_line(run_cli("--state-dir", "file:///tmp/x", "audit", "query", keystore=keystore_path), 2, message)
    r = run_cli("rotate", "status", keystore=keystore_path, env={"MRTR_KEYS_STATE_DIR": "file:///tmp/x"})
    one_line(r, 2, message)
    assert not any(p.name.startswith("file:") for p in tmp_path.rglob("*"))
    assert not Path("file:").exists()


def test_control_characters_in_an_error_are_shown_escaped_on_one_line(tmp_path: Path) -> None:
    """A path the user typed with a newline or an ESC cannot split the message or recolour the terminal."""
    r = run_cli("keys", "list", "--keystore", str(tmp_path / "a\nb\x1b[31mred"))
    one_line(r, 2, "no key ring at")
    assert "\x1b" not in r.err and "a b\\x1b[31mred" in r.err


def test_a_replay_store_url_or_audit_factory_that_cannot_work_is_refused_at_start(keystore_path: Path) -> None:
    """A trial run's mistakes in `serve`'s settings: a Redis URL with an unclosed ``[`` was an internal error
    (exit 1), ``/abc`` as the database quietly used database 0, a port past 65535 on PostgreSQL and an
    ``audit_factory`` that cannot be imported were not configuration errors (exit 1, or a store "down" for
    good); each is one line and exit 2 now, without the URL's password. (On a Unix socket of the test's own:
    nothing to race for.)"""
    sock = str(keystore_path.parent / "sidecar.sock")
    config = keystore_path.parent / "sidecar.toml"
    config.write_text('[sidecar]\naudit_factory = "nomod:nofn"\n')
    for url, says in (
        ("redis://:S3cretPW@[::1:6379/9", "bad replay store URL"),
        ("redis://:S3cretPW@127.0.0.1:6379/abc", "the database must be a number"),
        ("redis://127.0.0.1:6379/-1", "the database must be a number"),
        ("postgresql://u:S3cretPW@127.0.0.1:99999/db", "Port out of range"),
    ):
        r = run_cli("serve", "--uds", sock, "--replay-store", url, keystore=keystore_path, timeout=30)
        one_line(r, 2, says)
        assert "S3cretPW" not in r.out + r.err
    r = run_cli("serve", "--uds", sock, "--config", str(config), keystore=keystore_path, timeout=30)
    one_line(r, 2, "audit_factory 'nomod:nofn' cannot be imported")


def test_health_refuses_an_unreadable_url_or_timeout_in_one_line() -> None:
    """`health` is what probes run: `--url http://[::1` (an unclosed IPv6 host) or `http://host:abc`, and
    `--timeout -1`, nan or inf were 'internal error: ValueError: ...' (exit 1, as an unhealthy sidecar); a
    library `request_state_security(sidecar="http://[::1")` raised ValueError instead of ConfigError."""
    from mrtr_keys.codecs.sidecar_transport import sidecar_transport

    for args, said in (
        (("--url", "http://ops:S3cretPW@[::1"), "the sidecar URL 'http://[::1' cannot be read: Invalid IPv6 URL"),
        (("--url", "http://127.0.0.1:abc"), "the sidecar URL 'http://127.0.0.1:abc' cannot be read: Port could not be"),
        (("--url", "http://127.0.0.1:99999"), "the sidecar URL 'http://127.0.0.1:99999' cannot be read: Port out of"),
        (("--timeout", "-1"), "--timeout must be a number of seconds above 0 and at most 300"),
        (("--timeout", "nan"), "--timeout must be a number of seconds above 0 and at most 300"),
        (("--timeout", "inf"), "--timeout must be a number of seconds above 0 and at most 300"),
        (("--wait", "nan"), "--wait must be a number of seconds from 0 to 86400"),
    ):
        r = run_cli("health", *args)
        assert r.code == 2 and r.err.startswith(f"mrtr-keys: {said}") and r.err.count("\n") == 1, (args, r.err)
        assert "S3cretPW" not in r.err
    with pytest.raises(ConfigError, match="cannot be read: Invalid IPv6 URL"):
        sidecar_transport("http://[::1")


def test_a_keystore_audit_or_vault_url_that_cannot_be_parsed_is_one_line(tmp_path: Path) -> None:
    """An unclosed IPv6 host ('[::1') in a file:// keystore URL, a sqlite:// audit URL or VAULT_ADDR made urllib
    raise ValueError: 'internal error: ValueError: Invalid IPv6 URL', exit 1. Now a bad command line, exit 2."""
    for args, env, said in (
        (("keys", "list", "--keystore", "file://[::1/x"), {}, "cannot read the keystore URL 'file://[::1/x'"),
        (("--audit", "sqlite://[::1/x", "audit", "query"), {}, "cannot read the audit store URL 'sqlite://[::1/x'"),
        (
            ("keys", "list", "--keystore", "vault-kv://secret/ring"),
            {"VAULT_ADDR": "http://[::1", "VAULT_TOKEN": "t"},
            "Vault address 'http://[::1' cannot be read: Invalid IPv6 URL",
        ),
        (
            ("keys", "list", "--keystore", "vault-kv://secret/ring"),
            {"VAULT_ADDR": "http://vault:abc", "VAULT_TOKEN": "t"},
            "Vault address 'http://vault:abc' cannot be read: Port could not be cast",
        ),
    ):
        r = run_cli(*args, keystore=tmp_path / "keyring.json", env=env)
        assert r.code == 2 and r.err.startswith(f"mrtr-keys: {said}") and r.err.count("\n") == 1, (args, r.err)


def test_an_s3_location_without_a_valid_bucket_name_is_refused_up_front(tmp_path: Path) -> None:
    """botocore checks a bucket name only at the first call: `audit archive --to s3://bad_bucket!/x` was 'internal
    error: ParamValidationError' (exit 1), and `serve --audit-anchor s3://[::1` served, then logged a multi-line
    WARNING at every anchor run. Each is now one line and exit 2 before anything starts."""
    ring = tmp_path / "keyring.json"
    assert run_cli("init", keystore=ring).code == 0
    for args, bucket in (
        (("audit", "archive", "--before", "30d", "--to", "s3://bad_bucket!/x"), "bad_bucket!"),
        (("audit", "verify", "--checkpoints", "s3://[::1/x"), "[::1"),
        (("serve", "--port", str(_free_port()), "--audit-anchor", "s3://[::1"), "[::1"),
    ):
        r = run_cli(*args, keystore=ring, timeout=30)
        assert r.code == 2 and r.err.count("\n") == 1, (args, r.err)
        assert f"{bucket!r} is not a bucket name (letters, digits, '.', '-', '_')" in r.err, r.err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_audit_key_file_that_is_a_fifo_or_a_directory_is_one_line_never_a_hang(
    keystore_path: Path, tmp_path: Path
) -> None:
    """The audit key files (``MRTR_KEYS_AUDIT_KEY_FILE``, ``MRTR_KEYS_AUDIT_OLD_KEY_FILES`` and the state directory's
    ``audit.key``) were opened with a blocking open(2): a FIFO hung `audit verify` (and `serve`, and every
    writer) for ever, and a directory was ``internal error: IsADirectoryError``. Each is one line, exit 2."""
    assert run_cli("rotate", "begin", keystore=keystore_path).code == 0  # the CLI records it: the log exists
    fifo, directory = tmp_path / "key.fifo", tmp_path / "key.dir"
    os.mkfifo(fifo, 0o600)
    directory.mkdir(mode=0o700)
    for variable in ("MRTR_KEYS_AUDIT_KEY_FILE", "MRTR_KEYS_AUDIT_OLD_KEY_FILES"):
        for path in (fifo, directory):
            r = run_cli("audit", "verify", keystore=keystore_path, env={variable: str(path)}, timeout=30)
            one_line(r, 2, f"the audit key {path} ")
            assert "is not a regular file" in r.err
    own = keystore_path.parent / "audit.key"
    own.unlink()
    os.mkfifo(own, 0o600)
    r = run_cli("audit", "verify", keystore=keystore_path, timeout=30)
    one_line(r, 2, f"audit key {own} is not a regular file")


def test_a_jsonl_audit_store_that_is_a_fifo_a_device_or_a_directory_is_one_line_never_a_hang(
    keystore_path: Path, tmp_path: Path
) -> None:
    """``jsonl:///PATH`` naming a FIFO hung every command that opens the store (a blocking open(2) for writing
    waits for a reader); ``/dev/zero`` was read as one endless first line until memory ran out; a directory
    was exit 75 ("retry later"), which no retry cures. Each is now one line, exit 2."""
    assert run_cli("rotate", "begin", keystore=keystore_path).code == 0  # the audit key exists
    fifo, directory = tmp_path / "audit.fifo", tmp_path / "audit.dir"
    os.mkfifo(fifo, 0o600)
    directory.mkdir()
    for path in (fifo, Path("/dev/zero"), directory):
        r = run_cli("audit", "verify", "--audit", f"jsonl://{path}", keystore=keystore_path, timeout=30)
        one_line(r, 2, f"the audit store {path} is not a regular file")


def test_a_vault_service_account_token_file_that_is_a_fifo_is_one_line_never_a_hang(tmp_path: Path) -> None:
    """``VAULT_K8S_TOKEN_FILE`` (the Kubernetes login's JWT, read at each login) was opened with a blocking open(2):
    a FIFO hung every command and codec on a Vault keystore for ever before Vault was even asked. A FIFO, a
    device or a directory is now one line, exit 2, read not at all."""
    fifo, directory = tmp_path / "sa-token.fifo", tmp_path / "sa-token.dir"
    os.mkfifo(fifo, 0o600)
    directory.mkdir()
    with socket.socket() as closed:  # a Vault address nothing answers: the JWT is read before any request
        closed.bind(("127.0.0.1", 0))
        addr = f"http://127.0.0.1:{closed.getsockname()[1]}"
    for path in (fifo, Path("/dev/zero"), directory):
        pod = {"BAO_ADDR": addr, "VAULT_K8S_ROLE": "sidecar", "VAULT_K8S_TOKEN_FILE": str(path)}
        r = run_cli("keys", "list", "--keystore", "vault-kv://secret/mrtr/keyring", env=pod, timeout=30)
        one_line(r, 2, f"cannot read the service-account token for the Vault Kubernetes login at {path} (not a regular")


def test_rotate_next_if_older_than_beyond_what_a_date_holds_is_one_line(keystore_path: Path) -> None:
    """``rotate next --if-older-than 999999999999999d`` on an idle ring was ``internal error: OverflowError``
    (its due date past the year 9999). Over 100 years is refused in one line, exit 2, and nothing changes."""
    r = run_cli("rotate", "next", "--if-older-than", "999999999999999d", keystore=keystore_path)
    one_line(r, 2, "--if-older-than must be at most 36500d (100 years)")
    r = run_cli("rotate", "next", "--if-older-than", "36500d", keystore=keystore_path)
    assert r.code == 0 and r.out.startswith("nothing to do: primary "), (r.out, r.err)
