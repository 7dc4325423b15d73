"""The audit event: one seal, unseal, key ring change or ring load, with the fields every output uses.

Field names are fixed (they are the ``--json`` keys of every ``mrtr-keys audit`` command and the
column names of every store): ``time`` (UTC, ISO 8601 with microseconds and ``Z``), ``instance``
(host:pid:start of the process that recorded it), ``client`` (sidecar client id), ``audience``,
``kid``, ``op``, ``outcome`` (``ok`` or ``rejected``), ``reason`` (rejection code, ``forced``, or
``fenced-out`` on an ok seal or unseal served while fenced out, `mrtr_keys.codecs.fence`, ``over-budget``
on an ok seal by a key past its seal budget, `mrtr_keys.fleet.usage`),
``fingerprint`` (see `mrtr_keys.audit.writing.fingerprint`), ``generation`` (key ring generation) and
``duration_ms``. An event never holds a token, a payload, plaintext, key material or a secret.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from mrtr_keys.errors import ConfigError

FIELDS = (
    "time",
    "instance",
    "client",
    "audience",
    "kid",
    "op",
    "outcome",
    "reason",
    "fingerprint",
    "generation",
    "duration_ms",
)
"""Event field names, in output order."""

OP_SEAL = "seal"
OP_UNSEAL = "unseal"
OP_RING_LOADED = "ring-loaded"
CHANGE_OPS = (
    "init",
    "begin",
    "promote",
    "retire",
    "rewrap",
    "audience",
    "abort",
    "destroy",
    "ttl",
    "restore",
    "revoke",
)
OPS = (OP_SEAL, OP_UNSEAL, OP_RING_LOADED, *CHANGE_OPS)
OK = "ok"
REJECTED = "rejected"
FORCED = "forced"

STATS_KEYS = ("kid", "reason", "audience", "client", "instance", "op", "outcome")
"""Fields `stats --by` may group on."""


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """One audit record's content (the chain fields live in `mrtr_keys.audit.writing.chain.Record`)."""

    time: str
    instance: str
    op: str
    outcome: str = OK
    client: str | None = None
    audience: str | None = None
    kid: str | None = None
    reason: str | None = None
    fingerprint: str | None = None
    generation: int | None = None
    duration_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The event as a dict with exactly the `FIELDS` keys, in order."""
        d = asdict(self)
        return {name: d[name] for name in FIELDS}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> AuditEvent:
        """Inverse of `to_json` (extra keys ignored)."""
        gen = doc.get("generation")
        dur = doc.get("duration_ms")
        return cls(
            time=str(doc["time"]),
            instance=str(doc.get("instance") or ""),
            op=str(doc["op"]),
            outcome=str(doc.get("outcome") or OK),
            client=doc.get("client"),
            audience=doc.get("audience"),
            kid=doc.get("kid"),
            reason=doc.get("reason"),
            fingerprint=doc.get("fingerprint"),
            generation=int(gen) if gen is not None else None,
            duration_ms=float(dur) if dur is not None else None,
        )


_second: tuple[int, str] = (-1, "")


def format_ts(ts: float) -> str:
    """A POSIX time (seconds) as fixed-width ISO 8601 UTC, ``YYYY-MM-DDTHH:MM:SS.ffffffZ``.

    Fixed width, so text order is time order (the stores compare times as text). The
    ``YYYY-MM-DDTHH:MM:SS`` part is cached per second (the writer formats many per second).
    """
    global _second
    sec = int(ts)
    cached = _second
    if cached[0] != sec:
        cached = _second = (sec, datetime.fromtimestamp(sec, UTC).strftime("%Y-%m-%dT%H:%M:%S"))
    micros = int((ts - sec) * 1_000_000)
    return f"{cached[1]}.{min(micros, 999_999):06d}Z"


def format_dt(dt: datetime) -> str:
    """A datetime (naive means UTC) in the `format_ts` form."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_event_time(text: str) -> datetime:
    """Inverse of `format_ts` (any ISO 8601 with an offset is accepted)."""
    dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


_RELATIVE = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d|w)")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_when(text: str, *, now: datetime | None = None) -> str:
    """A ``--since``/``--until`` value as an event time string.

    Accepts a duration before now (``90s``, ``15m``, ``1h``, ``2d``, ``1w``) or an ISO 8601 date or
    time (``2026-07-28``, ``2026-07-28T10:00:00Z``, with an offset; no offset means UTC).

    Raises:
        ConfigError: neither form.
    """
    text = text.strip()
    m = _RELATIVE.fullmatch(text)
    if m is not None:
        base = now or datetime.now(UTC)
        try:
            return format_dt(base - timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)]))
        except OverflowError:
            raise ConfigError(f"time {text!r} reaches before year 1; use a shorter duration") from None
    try:
        return format_dt(parse_event_time(text))
    except (ValueError, OverflowError):
        raise ConfigError(f"cannot read time {text!r}: use a duration like 1h or 15m, or ISO 8601") from None


def plural(n: int, word: str, *, grouped: bool = False) -> str:
    """``"1 record"``, ``"2 records"``; `grouped`: ``"1,000 records"``."""
    count = f"{n:,}" if grouped else str(n)
    return f"{count} {word if n == 1 else word + 's'}"


_instance: tuple[int, str] | None = None


def instance_id() -> str:
    """This process as ``host:pid:start`` (start = process start in UTC, ``YYYYmmddTHHMMSSZ``).

    Recomputed after a fork (a child is another instance).
    """
    global _instance
    pid = os.getpid()
    if _instance is None or _instance[0] != pid:
        start = datetime.fromtimestamp(time.time(), UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        _instance = (pid, f"{socket.gethostname()}:{pid}:{start}")
    return _instance[1]
