"""What every part shares: the run settings and the realistic 300-byte payload."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

PAYLOAD_BYTES = 300


@dataclass(frozen=True)
class Settings:
    """Knobs for one run. `quick` shrinks every count so a smoke test finishes in seconds."""

    quick: bool = False
    repeats: int = 15
    inner: int = 5_000
    wrk_seconds: float = 5.0
    wrk_repeats: int = 3
    memory_ops: int = 1_000_000
    cli_runs: int = 15

    @classmethod
    def tiny(cls) -> Settings:
        return cls(quick=True, repeats=3, inner=200, wrk_seconds=1.0, wrk_repeats=1, memory_ops=20_000, cli_runs=3)


def envelope_payload(size: int = PAYLOAD_BYTES) -> bytes:
    """A claims envelope as the MCP SDK's `RequestStateBoundary._seal` builds it, padded to `size` bytes.

    Same keys and value shapes (compact JSON: version, iat/exp floats, method, target,
    16-byte args digest, audience, a principal claim, and the server's inner state).
    """
    now = time.time()
    claims: dict[str, Any] = {
        "v": 1,
        "iat": now,
        "exp": now + 600.0,
        "m": "tools/call",
        "t": "book_flight",
        "a": "q1Xv7c0k2XoV5mS1r4b9Zg",
        "s": "",
        "aud": "travel-agent",
        "p": "Qk9PS0lOR19QUklOQ0lQQUxfQ0xBSU0",
    }
    base = len(json.dumps(claims, separators=(",", ":")).encode())
    inner: dict[str, Any] = {"step": 2, "origin": "LHR", "dest": "SFO", "date": "2026-09-14", "pax": 2, "seat": ""}
    filler = size - base - len(json.dumps(inner, separators=(",", ":")))
    inner["seat"] = "x" * max(0, filler)
    claims["s"] = json.dumps(inner, separators=(",", ":"))
    out = json.dumps(claims, separators=(",", ":")).encode()
    # JSON-escaping of the inner string adds backslashes; trim the filler to land exactly.
    while len(out) > size and inner["seat"]:
        inner["seat"] = inner["seat"][: -(len(out) - size)] if len(out) - size < len(inner["seat"]) else ""
        claims["s"] = json.dumps(inner, separators=(",", ":"))
        out = json.dumps(claims, separators=(",", ":")).encode()
    return out


def random_payload(size: int = PAYLOAD_BYTES) -> bytes:
    return os.urandom(size)
