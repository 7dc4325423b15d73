"""The fleet check before a change writes a ring feature older releases cannot read (`mrtr_keys.fleet.compat_gate`;
our rule, from the strict ring reader: an instance that cannot read a ring keeps serving the old one).

Presence rows are written straight into a SQLite audit store, with the versions a fleet mid-upgrade reports."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from mrtr_keys.audit.events import format_dt
from mrtr_keys.audit.writing.stores.url import open_store
from mrtr_keys.errors import NotYet
from mrtr_keys.fleet.compat_gate import instances_that_cannot_read, refuse_unreadable
from mrtr_keys.fleet.instances import InstanceRecord
from mrtr_keys.ring.compat import KEY_STATE_REVOKED
from mrtr_keys.ring.model import KeyRing
from tests.fixtures.keyrings import T0, fresh_ring

NOW = T0 + timedelta(minutes=5)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[object]:
    s = open_store(f"sqlite://{tmp_path / 'audit.db'}")
    yield s
    s.close()


def _row(ring: KeyRing, name: str, version: str | None, *, beat_ago: float = 1.0, state: str = "running") -> tuple:
    beat = format_dt(NOW - timedelta(seconds=beat_ago))
    return InstanceRecord(
        name, "h", 1, "library", "local", ring.ring_id, 1, ring.primary.kid, version, beat, beat, 10.0, state
    ).row()


def test_only_live_instances_of_this_ring_on_an_older_release_are_named(store) -> None:  # type: ignore[no-untyped-def]
    ring, other = fresh_ring(), fresh_ring()
    rows = [
        _row(ring, "new", "0.2.0"),
        _row(ring, "newer", "0.3.1+local"),
        _row(ring, "old", "0.1.4"),
        _row(ring, "unreported", None),
        _row(ring, "old-but-stale", "0.1.4", beat_ago=31),  # 3 heartbeats of 10 s ago: it stops counting
        _row(ring, "old-but-stopped", "0.1.4", state="stopped"),
        _row(other, "old-other-ring", "0.1.4"),
    ]
    for row in rows:
        store.put_instance(row)
    found = instances_that_cannot_read(store, ring, [KEY_STATE_REVOKED], NOW)
    assert [(u.instance.name, u.features) for u in found] == [
        ("old", (KEY_STATE_REVOKED,)),
        ("unreported", (KEY_STATE_REVOKED,)),
    ]
    with pytest.raises(NotYet) as info:
        refuse_unreadable(store, ring, [KEY_STATE_REVOKED], NOW, what="keys revoke")
    message = str(info.value)
    assert info.value.exit_code == 75
    assert message.startswith("keys revoke not written: 2 live instance(s) run a release that cannot read it")
    assert "old (version 0.1.4, cannot read: key state revoked)" in message
    assert "unreported (version not reported" in message and "key state revoked needs 0.2.0" in message
    assert "override with --force" in message
    assert all(f"{name} (" not in message for name in ("new", "newer", "old-but-stale", "old-but-stopped", "old-other"))
    note = refuse_unreadable(store, ring, [KEY_STATE_REVOKED], NOW, force=True)
    assert note is not None and note.startswith("--force wrote it although 2 live instance(s) cannot read it")


def test_a_fleet_on_the_new_release_or_no_audit_store_passes(store) -> None:  # type: ignore[no-untyped-def]
    ring = fresh_ring()
    store.put_instance(_row(ring, "new", "0.2.0"))
    assert refuse_unreadable(store, ring, [KEY_STATE_REVOKED], NOW) is None
    assert refuse_unreadable(None, ring, [KEY_STATE_REVOKED], NOW) is None


def test_a_feature_nobody_registered_is_a_programming_error(store) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KeyError):
        instances_that_cannot_read(store, fresh_ring(), ["key state nonsense"], NOW)
