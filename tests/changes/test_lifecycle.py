"""Key ring changes outside the rotation phases (`mrtr_keys.changes.lifecycle`), with injected times.

Our decision: raising the TTL is in force at once; lowering it waits until the old
TTL + 60 s (the SDK's future skew) have passed since the request and since the last seal the
audit log shows from an instance that was running before it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mrtr_keys.audit.events import AuditEvent, format_dt
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.lifecycle import parse_duration, set_ttl
from mrtr_keys.errors import NotYet
from mrtr_keys.fleet.ttl_evidence import last_seal_by_earlier_instances
from mrtr_keys.ring.model import KeyRing
from tests.fixtures.audit import insert

T0 = datetime(2026, 7, 28, 10, 0, tzinfo=UTC)


def ring_at(tmp_path: Path, ttl: float = 600.0) -> KeyRing:
    from mrtr_keys.keystores.file import FileKeystore

    return create_ring(FileKeystore(tmp_path / "keyring.json"), ttl=ttl, now=T0).ring


def test_parse_duration() -> None:
    assert [parse_duration(t) for t in ("30d", "12h", "90m", "45s", "2w", "3600", "1.5h")] == [
        2592000,
        43200,
        5400,
        45,
        1209600,
        3600,
        5400,
    ]


def test_lowering_waits_for_the_old_ttl_after_the_request_and_after_old_instances_seal(tmp_path: Path) -> None:
    ring = ring_at(tmp_path, 600)
    asked = set_ttl(ring, 300, T0).ring
    assert asked.ttl_seconds == 600 and asked.server_ttl_limit == 300
    with pytest.raises(NotYet) as early:
        set_ttl(asked, 300, T0 + timedelta(seconds=659))
    assert round(early.value.wait_seconds) == 1
    late_seal = T0 + timedelta(seconds=100)
    with pytest.raises(NotYet, match="instance started before the request"):
        set_ttl(asked, 300, T0 + timedelta(seconds=700), last_old_seal=late_seal)
    done = set_ttl(asked, 300, T0 + timedelta(seconds=760), last_old_seal=late_seal).ring
    assert done.ttl_seconds == 300 and done.ttl_lowering is None
    assert set_ttl(ring, 1200, T0).ring.ttl_seconds == 1200


def test_audit_evidence_names_only_instances_running_before_the_request(make_sink, tmp_path: Path) -> None:
    sink = make_sink(f"sqlite:///{tmp_path}/audit.db")

    def seal(at: datetime, instance: str) -> AuditEvent:
        return AuditEvent(time=format_dt(at), instance=instance, op="seal", kid="aaaaaaaa", audience="billing")

    insert(
        sink,
        [
            seal(T0 - timedelta(seconds=30), "old"),
            seal(T0 + timedelta(seconds=20), "new"),  # started after the request: its ttl is the lower one
            seal(T0 + timedelta(seconds=50), "old"),
            seal(T0 + timedelta(seconds=90), "new"),
        ],
    )
    store = sink.store
    assert last_seal_by_earlier_instances(store, T0, 600) == T0 + timedelta(seconds=50)
    assert last_seal_by_earlier_instances(store, T0 - timedelta(seconds=60), 600) is None
