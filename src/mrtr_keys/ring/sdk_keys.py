"""MCP SDK secrets in a key ring: reading a key file for `mrtr-keys init --from-sdk-key-file`, and the
``sdk_key`` field of an ``sdk-v1`` key.

The MCP SDK's ``RequestStateSecurity(keys=[...])`` takes each key as bytes or text of at least 32
bytes ("any format": a ``str`` is used as its UTF-8 bytes) and stretches it with HKDF itself
(`mcp/server/request_state.py`). A key file therefore holds the key exactly as the SDK is given it:

* raw (no ``--encoding``): every byte of the file is the one key; a file that ends in a line break is
  refused, because the SDK would only see that byte if the servers read the file the same way;
* ``--encoding hex`` or ``--encoding base64``: one key a line, each decoded strictly by the declared
  encoding (hex: only ``0-9a-fA-F``, an even count; base64: the standard alphabet, padded, canonical,
  RFC 4648 section 4); the first line is ``keys[0]``, the one that seals. Nothing is ever guessed.

Every error is one line that names the file and the line, never a byte of the key.
"""

from __future__ import annotations

import base64
import binascii
import os
import re

from mrtr_keys.errors import ConfigError, KeyRingError
from mrtr_keys.files import read_small_file

MIN_SDK_KEY_BYTES = 32
"""The MCP SDK's minimum for a `RequestStateSecurity(keys=[...])` secret (bytes)."""
MAX_SDK_KEY_BYTES = 4096
"""Longest SDK secret a ring accepts (bytes); the SDK sets no cap, a key file needs one."""
MAX_KEY_FILE_BYTES = 64 * 1024
"""Largest key file read (bytes)."""
ENCODINGS = ("hex", "base64")
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")


def read_sdk_key_file(path: str | os.PathLike[str], encoding: str | None = None) -> list[bytes]:
    """The SDK keys in `path`, ``keys[0]`` first (see the module docstring for the file's forms).

    Args:
        path: the key file.
        encoding: None (raw: the whole file is one key), ``"hex"`` or ``"base64"`` (one key a line).

    Returns:
        One or more keys, each 32 to 4096 bytes, no two equal.

    Raises:
        ConfigError: the file cannot be read, is empty, too short or long, or does not decode; one line,
            never echoing the key.
    """
    if encoding is not None and encoding not in ENCODINGS:
        raise ConfigError(f"--encoding must be hex or base64 (or left out for a raw key), not {encoding!r}")
    name = str(path)
    data = read_small_file(path, "the key file", MAX_KEY_FILE_BYTES)
    if not data:
        raise ConfigError(f"the key file {name} is empty")
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"the key file {name} is over {MAX_KEY_FILE_BYTES} bytes; it is not a key file")
    if encoding is None:
        if data.endswith(b"\n"):
            raise ConfigError(
                f"the key file {name} ends in a line break, and a raw key file is taken byte for byte: write it "
                "without one (printf '%s'), or give the key as text with --encoding hex or --encoding base64"
            )
        return [_checked(data, name, "")]
    return _decode_lines(data, name, encoding)


def _decode_lines(data: bytes, name: str, encoding: str) -> list[bytes]:
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(f"the key file {name} is not {encoding} text (it holds non-ASCII bytes)") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final line break ends the last line
    if not lines:
        raise ConfigError(f"the key file {name} is empty")
    keys: list[bytes] = []
    for number, line in enumerate(lines, start=1):
        line = line.removesuffix("\r")
        where = f" line {number}"
        if not line:
            raise ConfigError(f"the key file {name}{where} is empty (one key a line, no blank lines)")
        key = _decode_hex(line, name, where) if encoding == "hex" else _decode_base64(line, name, where)
        key = _checked(key, name, where)
        if key in keys:
            raise ConfigError(f"the key file {name}{where} repeats an earlier key")
        keys.append(key)
    return keys


def _decode_hex(line: str, name: str, where: str) -> bytes:
    if _HEX.fullmatch(line) is None:
        raise ConfigError(f"the key file {name}{where} is not hex (only 0-9 and a-f, an even number of them)")
    return bytes.fromhex(line)


def _decode_base64(line: str, name: str, where: str) -> bytes:
    bad = f"the key file {name}{where} is not standard base64 (A-Z a-z 0-9 + /, padded with =; RFC 4648 section 4)"
    try:
        raw = base64.b64decode(line, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(bad) from None
    if base64.b64encode(raw).decode("ascii") != line:
        raise ConfigError(f"{bad}: non-canonical")
    return raw


def _checked(key: bytes, name: str, where: str) -> bytes:
    if len(key) < MIN_SDK_KEY_BYTES:
        raise ConfigError(
            f"the key in {name}{where} is {len(key)} bytes; the MCP SDK takes keys of at least {MIN_SDK_KEY_BYTES}"
        )
    if len(key) > MAX_SDK_KEY_BYTES:
        raise ConfigError(f"the key in {name}{where} is {len(key)} bytes; at most {MAX_SDK_KEY_BYTES} are accepted")
    return key


def strict_b64decode(value: str, expected: str) -> bytes:
    """`value` as strict, canonical standard base64 (RFC 4648 section 4): only the one spelling
    `base64.b64encode` gives of some bytes decodes.

    Raises:
        KeyRingError: `expected` and why (never the value itself).
    """
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise KeyRingError(f"{expected} (it does not decode)") from None
    if base64.b64encode(raw).decode("ascii") != value:
        raise KeyRingError(f"{expected} (non-canonical encoding)")
    return raw


def decode_sdk_key(value: object, kid: str) -> bytes:
    """The ``sdk_key`` field of a ring document: strict standard base64 of 32 to 4096 bytes.

    Raises:
        KeyRingError: anything else (the message never echoes the value).
    """
    expected = f"key {kid}: sdk_key must be standard base64 of {MIN_SDK_KEY_BYTES} to {MAX_SDK_KEY_BYTES} bytes"
    if not isinstance(value, str) or not value.isascii() or len(value) > 2 * MAX_SDK_KEY_BYTES:
        raise KeyRingError(expected)
    raw = strict_b64decode(value, expected)
    if not MIN_SDK_KEY_BYTES <= len(raw) <= MAX_SDK_KEY_BYTES:
        raise KeyRingError(f"{expected} (it decodes to {len(raw)} bytes)")
    return raw
