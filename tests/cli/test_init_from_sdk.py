"""`mrtr-keys init --from-sdk-key-file PATH [--encoding hex|base64]`: the key file holds the key
as the MCP SDK's `RequestStateSecurity(keys=[...])` takes it, decoded strictly by the declared encoding;
every bad file is a one-line refusal (exit 2) that never echoes the key, and no ring is written."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
from mcp.server.request_state import AESGCMRequestStateCodec

from mrtr_keys.codecs.sdk_v1 import sdk_kid
from mrtr_keys.errors import ConfigError
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import KeyFormat, KeyState
from mrtr_keys.ring.sdk_keys import read_sdk_key_file
from tests.cli.test_cli import ok, parallel, refused
from tests.fixtures.common import run_cli
from tests.fixtures.sdk_keys import key_secrets


def test_raw_hex_and_base64_key_files_start_a_ring_whose_primary_is_the_sdk_key(tmp_path: Path) -> None:
    """Raw: the file's bytes are keys[0] (a hex string given to the SDK as text is its ASCII bytes, not
    decoded); hex / base64: one key a line, first is keys[0], the others verify keys."""
    k0, k1, k2 = os.urandom(32), os.urandom(40), os.urandom(64)
    raw_text = os.urandom(32).hex().encode()  # keys=["<64 hex chars>"]: the SDK uses the 64 ASCII bytes
    files = {
        "raw-text": (raw_text, ()),
        "hex": ((k0.hex() + "\n" + k1.hex().upper() + "\r\n").encode(), ("--encoding", "hex")),
    }
    calls = []
    for name, (content, flags) in files.items():
        (tmp_path / f"{name}.key").write_bytes(content)
        ring = tmp_path / name / "keyring.json"
        calls.append(("init", "--from-sdk-key-file", str(tmp_path / f"{name}.key"), *flags, "--keystore", str(ring)))
    results = parallel(*calls)
    expected = {"raw-text": [raw_text], "hex": [k0, k1]}
    for (name, keys), result in zip(expected.items(), results, strict=True):
        out = ok(result).out
        ring = FileKeystore(tmp_path / name / "keyring.json").load()
        assert [(k.kid, k.state, k.format, k.material) for k in ring.keys] == [
            (sdk_kid(key), KeyState.PRIMARY if i == 0 else KeyState.VERIFY, KeyFormat.SDK_V1, key)
            for i, key in enumerate(keys)
        ]
        assert f"primary key: {sdk_kid(keys[0])} (MCP SDK format: v1. tokens)" in out
        for secret in key_secrets(*keys):
            assert secret not in out
    (tmp_path / "raw.key").write_bytes(k2)
    (tmp_path / "b64.key").write_bytes(base64.b64encode(k2) + b"\n" + base64.b64encode(k0))
    assert read_sdk_key_file(tmp_path / "raw.key") == [k2]
    assert read_sdk_key_file(tmp_path / "b64.key", "base64") == [k2, k0]
    # The SDK's own codec with keys=[k0, k1] and the hex-started ring name the same kid (the SDK's).
    token = AESGCMRequestStateCodec([k0, k1]).seal(b"{}")
    assert (
        bytes.fromhex(FileKeystore(tmp_path / "hex" / "keyring.json").load().primary.kid)
        == base64.urlsafe_b64decode(token[3:] + "=" * (-len(token[3:]) % 4))[:4]
    )


def test_bad_key_files_are_one_line_refusals_that_never_echo_the_key_and_write_no_ring(tmp_path: Path) -> None:
    key = os.urandom(32)
    short = os.urandom(31)
    cases: dict[str, tuple[bytes, tuple[str, ...], str]] = {
        "empty": (b"", (), "is empty"),
        "empty-hex": (b"\n", ("--encoding", "hex"), "is empty"),
        "short-raw": (short, (), "is 31 bytes; the MCP SDK takes keys of at least 32"),
        "short-hex": (short.hex().encode() + b"\n", ("--encoding", "hex"), "line 1 is 31 bytes"),
        "raw-newline": (key.hex().encode() + b"\n", (), "ends in a line break"),
        "b64-as-hex": (base64.b64encode(key), ("--encoding", "hex"), "line 1 is not hex"),
        "binary-as-b64": (key, ("--encoding", "base64"), "is not base64 text"),
        "urlsafe-as-b64": (
            base64.urlsafe_b64encode(b"\xfb" * 33),
            ("--encoding", "base64"),
            "line 1 is not standard base64",
        ),
        "unpadded-b64": (base64.b64encode(key).rstrip(b"="), ("--encoding", "base64"), "is not standard base64"),
        "blank-line": (key.hex().encode() + b"\n\n" + os.urandom(32).hex().encode(), ("--encoding", "hex"), "line 2"),
        "repeat": ((key.hex() + "\n" + key.hex()).encode(), ("--encoding", "hex"), "line 2 repeats an earlier key"),
        "odd-hex": (key.hex().encode() + b"a", ("--encoding", "hex"), "an even number"),
    }
    via_cli = ("empty", "short-raw", "b64-as-hex")
    calls = []
    for name, (content, flags, fragment) in cases.items():
        path = tmp_path / f"{name}.key"
        path.write_bytes(content)
        if name in via_cli:
            calls.append(("init", "--from-sdk-key-file", str(path), *flags, "--keystore", str(tmp_path / name)))
            continue
        with pytest.raises(ConfigError) as info:  # the same function `init` calls, in-process
            read_sdk_key_file(path, flags[1] if flags else None)
        message = str(info.value)
        assert fragment in message and "\n" not in message, message
        for secret in key_secrets(key, short):
            assert secret not in message
    calls.append(("init", "--from-sdk-key-file", str(tmp_path / "missing.key"), "--keystore", str(tmp_path / "m")))
    calls.append(("init", "--encoding", "hex", "--keystore", str(tmp_path / "no-file")))
    calls.append(("init", "--from-sdk-key-file", str(tmp_path / "short-raw.key"), "--encoding", "base32"))
    calls.append(("init", "--from-sdk-key-file", str(tmp_path / "b64-as-hex.key"), "--codec", "kms"))
    results = parallel(*calls)
    fragments = [cases[name][2] for name in via_cli]
    fragments += ["cannot read the key file", "give that file too", "--encoding must be hex or base64", "local"]
    secrets = (*key_secrets(key, short), base64.b64encode(key).decode().rstrip("="))
    for call, result, fragment in zip(calls, results, fragments, strict=True):
        line = refused(result, 2, fragment)
        for secret in secrets:
            assert secret not in line + result.out, call
    assert not any(p.is_dir() for p in tmp_path.iterdir()), "a ring directory was written"


def test_a_key_file_that_is_a_fifo_or_a_device_is_refused_not_waited_on(tmp_path: Path) -> None:
    """`init --from-sdk-key-file` opened the file with a blocking open, so a FIFO named by mistake hung the command
    for ever (nothing ever writes to it); a directory said 'Is a directory'. Each is one line, exit 2, no ring."""
    fifo = tmp_path / "sdk.fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero"), tmp_path):
        res = run_cli("init", "--from-sdk-key-file", str(path), keystore=tmp_path / "ring.json", timeout=30)
        assert (res.code, res.err) == (2, f"mrtr-keys: cannot read the key file {path}: not a regular file\n")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_sdk_key_file(fifo)
    assert not (tmp_path / "ring.json").exists()
