"""`mrtr-keys clients ...`, the registry's hashing, the bearer parser and `serve` option checks."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mrtr_keys.errors import ConfigError
from mrtr_keys.service.auth import bearer_secret
from mrtr_keys.service.clients import ClientRegistry, add_client, hash_secret, load_registry
from mrtr_keys.service.config import ServiceConfig, load_config
from tests.fixtures.common import run_cli


def test_clients_add_list_remove_through_the_cli(keystore_path: Path) -> None:
    """Add prints the secret once (--json: client and secret); list never shows it; remove."""
    added = run_cli(
        "clients",
        "add",
        "billing",
        "--audience",
        "billing",
        "--audience",
        "bill",
        "--ops",
        "seal",
        "--json",
        keystore=keystore_path,
    )
    assert added.code == 0, added.err
    doc = added.json()
    secret = doc["secret"]
    assert doc["client"] == {
        "name": "billing",
        "audiences": ["bill", "billing"],
        "ops": ["seal"],
        "created_at": doc["client"]["created_at"],
    }
    assert secret.startswith("mks_") and len(secret) == 4 + 43
    registry = keystore_path.parent / "clients.json"
    assert secret not in registry.read_text()
    assert registry.stat().st_mode & 0o777 == 0o600
    assert load_registry(registry).authenticate(secret.encode()) is not None
    listed = run_cli("clients", "list", "--json", keystore=keystore_path)
    assert listed.json()["clients"][0]["name"] == "billing"
    assert secret not in listed.out and hash_secret(secret) not in listed.out
    again = run_cli("clients", "add", "billing", "--audience", "x", keystore=keystore_path)
    assert again.code == 2 and "already exists" in again.err
    bad = run_cli("clients", "add", "x", "--audience", "a", "--ops", "decrypt", keystore=keystore_path)
    assert bad.code == 2 and "unknown operation" in bad.err
    removed = run_cli("clients", "remove", "billing", keystore=keystore_path)
    assert removed.code == 0 and "removed" in removed.out
    assert len(load_registry(registry)) == 0


def test_registry_lookup_is_by_hash_and_exact(tmp_path: Path) -> None:
    """A secret authenticates its own client only; a near miss (case, prefix, extra byte) never does."""
    path = tmp_path / "clients.json"
    client, secret = add_client(path, "a", audiences=["billing"])
    registry = load_registry(path)
    assert registry.authenticate(secret) == client
    for near in (secret.upper(), secret[:-1], secret + "A", " " + secret, ""):
        assert registry.authenticate(near) is None
    assert client.allows("seal", "billing") and not client.allows("seal", "Billing")
    assert not client.allows("seal", "billing-admin") and not client.allows("rotate", "billing")
    with pytest.raises(ConfigError):
        ClientRegistry.loads(b'{"format": "mrtr-keys.clients", "version": 1, "clients": [{"name": "a"}]}')


@given(st.binary(max_size=600))
def test_bearer_parser_never_raises(value: bytes) -> None:
    """Untrusted header bytes: the parser returns the secret or None, never raises (property test)."""
    out = bearer_secret([(b"authorization", value)])
    assert out is None or (value[7:].strip() == out and value[:7].lower() == b"bearer ")


def test_bearer_parser_cases() -> None:
    assert bearer_secret([(b"authorization", b"Bearer abc")]) == b"abc"
    assert bearer_secret([(b"authorization", b"bearer abc")]) == b"abc"
    assert bearer_secret([(b"authorization", b"Basic abc")]) is None
    assert bearer_secret([(b"authorization", b"Bearer ")]) is None
    assert bearer_secret([]) is None


@pytest.mark.parametrize("value", [-1, math.nan, math.inf, 1e12, True])
def test_reload_interval_out_of_range_is_refused(value: float) -> None:
    """Numeric settings out of range (negative, NaN, infinity, 1e12) are refused with the setting's name
    (0 is allowed: it turns reload off)."""
    with pytest.raises(ConfigError, match="reload_interval"):
        ServiceConfig(reload_interval=value)


@pytest.mark.parametrize(
    ("name", "value"),
    [("port", 0), ("port", 70000), ("workers", 0), ("max_body_bytes", 10**12), ("max_batch_items", -1)],
)
def test_integer_settings_out_of_range_are_refused(name: str, value: int) -> None:
    with pytest.raises(ConfigError, match=name):
        ServiceConfig(**{name: value})  # type: ignore[arg-type]


def test_serve_refuses_bad_options_with_exit_2(keystore_path: Path, tmp_path: Path) -> None:
    """`mrtr-keys serve` exits 2 with one line naming the option; a config file with an unknown key too."""
    for value in ("-1", "nan"):  # the rest of the range checks: test_reload_interval_out_of_range_is_refused
        r = run_cli("serve", "--reload-interval", value, keystore=keystore_path)
        assert r.code == 2 and "reload_interval" in r.err, (value, r.err)
    cfg = tmp_path / "sidecar.toml"
    cfg.write_text("[sidecar]\nport = 8750\nreload = 3\n")
    r = run_cli("serve", "--config", str(cfg), keystore=keystore_path)
    assert r.code == 2 and "unknown sidecar setting" in r.err


def test_serve_reads_only_a_config_sized_regular_file(keystore_path: Path, tmp_path: Path) -> None:
    """`serve --config` read the file with read_bytes(): a FIFO blocked for ever, /dev/zero was read until memory ran
    out, and a directory was 'Is a directory' (the client registry and the ring refuse all such already)."""
    fifo, big = tmp_path / "sidecar.fifo", tmp_path / "big.toml"
    os.mkfifo(fifo)
    big.write_bytes(b"#" * (1024 * 1024 + 1))
    for cfg, said in (
        (fifo, "not a regular file"),
        (Path("/dev/zero"), "not a regular file"),
        (tmp_path, "not a regular file"),
        (big, "larger than 1,048,576 bytes"),
    ):
        r = run_cli("serve", "--config", str(cfg), keystore=keystore_path, timeout=30)
        assert (r.code, r.err) == (2, f"mrtr-keys: cannot read config file {cfg}: {said}\n")


def test_config_file_and_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "sidecar.toml"
    cfg.write_text("[sidecar]\nport = 9000\nreload_interval = 5\nmax_batch_items = 10\n")
    config = load_config(cfg).with_overrides(port=9001, host=None)
    assert (config.port, config.reload_interval, config.max_batch_items, config.host) == (9001, 5, 10, "127.0.0.1")


def test_workers_get_their_settings_in_the_import_string_not_the_environment() -> None:
    """uvicorn gives spawned workers only an import string: the settings (audit store included) ride in it."""
    import importlib
    import os

    from mrtr_keys.service.server import worker_import_string

    config = ServiceConfig(
        keystore="/srv/ring.json", workers=3, audit="jsonl:///srv/audit.jsonl", log_format="json", reload_interval=0.5
    )
    before = dict(os.environ)
    module, _, attr = worker_import_string(config).partition(":")
    factory = getattr(importlib.import_module(module), attr)
    assert factory.args == (config,)
    assert dict(os.environ) == before
    with pytest.raises(ConfigError, match="audit"):
        ServiceConfig(audit=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="log_format"):
        ServiceConfig(log_format="xml")


@pytest.mark.parametrize(
    ("line", "name"),
    [
        ("uds = []", "uds"),
        ('uds = "/run/x\\u0000y"', "uds"),
        ("clients = 1", "clients"),
        ("keystore = 1", "keystore"),
        ("state_dir = false", "state_dir"),
        ("instance = 7", "instance"),
        ("audit_factory = 1", "audit_factory"),
    ],
)
def test_a_config_file_path_or_name_that_is_not_text_is_refused_naming_it(
    keystore_path: Path, tmp_path: Path, line: str, name: str
) -> None:
    """The paths and names of a config file were not checked: ``uds = []`` served on TCP instead, as if unset;
    ``clients = 1``, ``audit_factory = 1`` or a NUL byte in ``uds`` was ``internal error: TypeError`` (or
    ``ValueError: embedded null byte``); ``keystore = 1`` looked for a ring in a file named ``1``. Each is one
    line, exit 2, naming the setting, and nothing is served."""
    cfg = tmp_path / "sidecar.toml"
    with socket.socket() as taken:  # were it served, it would fail another way (port in use), not hang
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg.write_text(f"[sidecar]\nport = {taken.getsockname()[1]}\n{line}\n")
        r = run_cli("serve", "--config", str(cfg), keystore=keystore_path, timeout=30)
    assert r.code == 2 and r.err.count("\n") == 1, r.err
    assert r.err.startswith(f"mrtr-keys: {name} must be a string without a NUL byte"), r.err


def test_the_settings_repr_shows_no_store_password() -> None:
    """The sidecar's settings are handed to code that is not ours (``audit_factory`` is called with them): the
    dataclass's own repr showed ``replay_store`` and ``audit`` whole, passwords included. They show as ``***``."""
    config = ServiceConfig(
        replay_store="redis://:r3play-pw@127.0.0.1:6379/13",
        audit="postgresql://mrtr:audit-pw@127.0.0.1/audit?password=query-pw",
    )
    shown = repr(config)
    assert not any(pw in shown for pw in ("r3play-pw", "audit-pw", "query-pw")), shown
    assert "replay_store='redis://:***@127.0.0.1:6379/13'" in shown and "port=8750" in shown
    assert config.to_json()["replay_store"] == "redis://:r3play-pw@127.0.0.1:6379/13"  # the workers still get it


def test_a_client_registry_nested_too_deeply_is_one_line(keystore_path: Path, tmp_path: Path) -> None:
    """A registry file holding one value nested 100,000 deep was ``internal error: RecursionError`` for `clients`
    and `serve` (and escaped the running sidecar's registry reload, which keeps the loaded registry on any other
    broken file). It is one line, exit 2, like any other registry that is not JSON."""
    registry = tmp_path / "clients.json"
    registry.write_text("[" * 100_000 + "]" * 100_000)
    registry.chmod(0o600)
    r = run_cli("clients", "list", "--clients", str(registry), keystore=keystore_path)
    assert (r.code, r.err) == (2, "mrtr-keys: client registry JSON is nested too deeply\n")
