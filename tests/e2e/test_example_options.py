"""The example server's key-source flags, resolved in-process (what `python -m mrtr_keys.example` does first)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.example.__main__ import build_parser, describe_security, security_from_args
from mrtr_keys.keystores.file import FileKeystore


def test_codec_from_ring_is_the_default_and_opens_the_rings_codec(keystore_path: Path) -> None:
    args = build_parser().parse_args(["--keystore", str(keystore_path), "--audience", "provisioner"])
    security = security_from_args(args)
    assert security is not None
    assert isinstance(security.codec, LocalAESGCMCodec)
    assert (security.audience, security.ttl) == ("provisioner", 600.0)
    kid = FileKeystore(keystore_path).load().primary.kid
    assert f"primary key {kid}" in describe_security(security)


def test_sdk_default_key_means_no_policy_so_the_sdk_makes_its_own_key(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--keystore", str(tmp_path / "absent.json"), "--sdk-default-key"])
    assert security_from_args(args) is None
    assert "valid in this process only" in describe_security(None)


def test_the_two_key_sources_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--codec-from-ring", "--sdk-default-key"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_create_ring_makes_a_local_ring_once_and_then_reuses_it(tmp_path: Path) -> None:
    # What `make run` relies on: a ring under ./.mrtr/ on first run, the same ring after.
    path = tmp_path / ".mrtr" / "keyring.json"
    args = build_parser().parse_args(["--keystore", str(path), "--create-ring"])
    first = security_from_args(args)
    kid = FileKeystore(path).load().primary.kid
    second = security_from_args(args)
    assert first is not None and second is not None
    assert FileKeystore(path).load().primary.kid == kid
    assert path.stat().st_mode & 0o777 == 0o600
    assert second.codec.unseal(first.codec.seal(b"round")) == b"round"


@pytest.mark.parametrize(("port", "said"), [("99999", "from 1 to 65535, not 99999"), ("0", "from 1 to 65535, not 0")])
def test_a_port_outside_1_to_65535_is_one_line_and_exit_2(
    port: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--port 99999` started the server on port 34463 (uvicorn binds the port modulo 2^16) while it printed
    http://127.0.0.1:99999/mcp as the URL to call; `--port 0` printed port 0 and listened on a random one."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--port", port])
    assert exited.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"python -m mrtr_keys.example: error: argument --port: must be {said}"


def test_an_sdk_key_file_that_is_a_fifo_or_a_directory_is_one_line_not_a_hang(tmp_path: Path) -> None:
    """`--sdk-key-file` read the path with `read_bytes`: a FIFO (nothing ever writes to it) hung the example
    server before it started, and `/dev/zero` was read until memory ran out."""
    from mrtr_keys.errors import ConfigError

    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path, Path("/dev/zero")):
        args = build_parser().parse_args(["--sdk-key-file", str(path)])
        with pytest.raises(ConfigError) as refused:
            security_from_args(args)
        assert str(refused.value) == f"cannot read --sdk-key-file {path}: not a regular file"
