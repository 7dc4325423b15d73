"""Presence records: the instance name, what an instance has loaded, and one row of the ``instances`` table.

An instance is **live** while its last heartbeat is younger than `LIVE_INTERVALS` of its own
intervals, **stale** after that (it crashed or cannot reach the store), and **stopped** at once after
a clean shutdown. What ``fleet status`` shows (`InstanceRecord.shown`) also says **stuck** for a live
instance whose heartbeat reports its ring watcher stuck (issue 22): it beats, but loads nothing newer.
`mrtr_keys.fleet.presence` writes the rows; the rotation gates (`mrtr_keys.fleet.gates`) and
``mrtr-keys fleet status`` read them.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mrtr_keys.audit.events import parse_event_time
from mrtr_keys.audit.writing.stores.base import INSTANCE_COLUMNS
from mrtr_keys.errors import ConfigError
from mrtr_keys.keystores.watch import STUCK_NOTE

if TYPE_CHECKING:
    from mrtr_keys.audit.writing.stores.base import AuditStore

ENV_INSTANCE = "MRTR_KEYS_INSTANCE"
DEFAULT_HEARTBEAT = 10.0
"""Seconds between heartbeats."""
LIVE_INTERVALS = 3
"""An instance is live while its last heartbeat is younger than this many of its intervals."""
LIVE, STALE, STOPPED = "live", "stale", "stopped"
STUCK = "stuck"
"""Shown (never a gate status) for a live instance whose ring watcher is stuck."""
RUNNING = "running"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,199}")


def instance_name(name: str | None = None) -> str:
    """The instance name: `name`, else ``MRTR_KEYS_INSTANCE``, else ``host:pid``.

    Raises:
        ConfigError: not 1-200 characters of letters, digits and ``. _ : @ / + -``.
    """
    value = name or os.environ.get(ENV_INSTANCE) or f"{socket.gethostname()}:{os.getpid()}"
    if not _NAME.fullmatch(value):
        raise ConfigError(
            "an instance name is 1-200 characters of letters, digits and . _ : @ / + - (starting with a letter "
            f"or digit), not {value[:40]!r}"
        )
    return value


def check_heartbeat(value: object) -> float:
    """`value` as a heartbeat interval in seconds.

    Raises:
        ConfigError: not a number from 0.05 to 3600.
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not (ok and 0.05 <= value <= 3600):  # type: ignore[operator]
        raise ConfigError("the heartbeat interval must be a number of seconds from 0.05 to 3600")
    return float(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Loaded:
    """What one source (a codec, the sidecar's ring) has loaded."""

    codec: str
    ring_id: str
    generation: int
    primary_kid: str
    note: str | None = None
    """Why the loaded ring may be behind the keystore (reload off, keystore unreachable, a ring refused)."""


Source = Callable[[], Loaded | None]
"""Returns what is loaded now, or None once the source is gone (its codec was garbage collected)."""


@dataclass(frozen=True)
class InstanceRecord:
    """One presence row (times are event time strings, `mrtr_keys.audit.events.format_ts`)."""

    name: str
    host: str | None
    pid: int | None
    kind: str | None
    codec: str | None
    ring_id: str | None
    generation: int | None
    primary_kid: str | None
    version: str | None
    started: str
    beat: str
    every_s: float
    state: str
    note: str | None = None

    @classmethod
    def from_row(cls, row: tuple[object, ...]) -> InstanceRecord:
        name, host, pid, kind, codec, ring_id, gen, kid, version, started, beat, every, state, note = row
        return cls(
            str(name),
            None if host is None else str(host),
            None if pid is None else int(pid),  # type: ignore[call-overload]
            None if kind is None else str(kind),
            None if codec is None else str(codec),
            None if ring_id is None else str(ring_id),
            None if gen is None else int(gen),  # type: ignore[call-overload]
            None if kid is None else str(kid),
            None if version is None else str(version),
            str(started),
            str(beat),
            float(every),  # type: ignore[arg-type]
            str(state),
            None if note is None else str(note),
        )

    def row(self) -> tuple[object, ...]:
        return (
            self.name,
            self.host,
            self.pid,
            self.kind,
            self.codec,
            self.ring_id,
            self.generation,
            self.primary_kid,
            self.version,
            self.started,
            self.beat,
            self.every_s,
            self.state,
            self.note,
        )

    @property
    def watcher_stuck(self) -> bool:
        """True when the instance reported its ring watcher stuck (no check completed in 3 intervals,
        `mrtr_keys.keystores.watch.STUCK_NOTE`): whatever generation it reports, it loads nothing newer."""
        return bool(self.note and self.note.startswith(STUCK_NOTE))

    def age(self, now: float) -> float:
        """Seconds since the last heartbeat at POSIX time `now`."""
        return now - parse_event_time(self.beat).timestamp()

    def status(self, now: float) -> str:
        """`LIVE`, `STALE` or `STOPPED` at POSIX time `now`."""
        if self.state == STOPPED:
            return STOPPED
        return LIVE if self.age(now) < LIVE_INTERVALS * self.every_s else STALE

    def shown(self, now: float) -> str:
        """What ``fleet status`` shows: `status`, except `STUCK` for a live instance whose ring watcher
        is stuck (it is live to the gates, which hold it as not having loaded anything newer)."""
        status = self.status(now)
        return STUCK if status == LIVE and self.watcher_stuck else status

    def to_json(self, now: float) -> dict[str, Any]:
        """The row's columns, plus ``status`` (`shown`), ``current`` (live with a watcher that checks)
        and ``age_seconds``."""
        doc = dict(zip(INSTANCE_COLUMNS, self.row(), strict=True))
        doc["status"] = self.shown(now)
        doc["current"] = doc["status"] == LIVE
        doc["age_seconds"] = round(self.age(now), 3)
        return doc


def read_instances(store: AuditStore) -> list[InstanceRecord]:
    """Every presence row in `store`, by name.

    Raises:
        AuditError: the store cannot be read.
    """
    return [InstanceRecord.from_row(r) for r in store.instances()]
