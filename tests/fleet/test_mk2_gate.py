"""``rotate begin`` writes no key a live instance cannot read (`mrtr_keys.fleet.compat_gate`, issue 36): it
makes an ``mk2`` key only once no live instance of the ring runs a release before 0.2.0 (exit 75 naming them
otherwise); ``--key-format mk1`` is the way around, and stale or stopped instances do not count.

Instances are presence rows written straight into the audit store (a release before 0.2.0 cannot be run here).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mrtr_keys.audit.events import format_ts
from mrtr_keys.audit.writing.stores.url import open_store
from mrtr_keys.changes.apply import apply_change
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.lifecycle import abort
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.errors import NotYet
from mrtr_keys.fleet.compat_gate import instances_that_cannot_read, readers_check_for
from mrtr_keys.fleet.instances import RUNNING, STOPPED, InstanceRecord
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.compat import KEY_FORMAT_MK2
from mrtr_keys.ring.model import KeyFormat, utcnow
from tests.fixtures.common import run_cli


def _instance(
    name: str, ring_id: str, version: str | None, *, age: float = 0.0, state: str = RUNNING
) -> InstanceRecord:
    now = time.time()
    return InstanceRecord(
        name=name,
        host="h",
        pid=1,
        kind="library",
        codec="local",
        ring_id=ring_id,
        generation=1,
        primary_kid="00000000",
        version=version,
        started=format_ts(now - 60),
        beat=format_ts(now - age),
        every_s=10.0,
        state=state,
    )


@pytest.fixture
def fleet(tmp_path: Path) -> tuple[FileKeystore, str]:
    """A ring made before 0.2.0 would have made it (mk1 primary) and its audit store's URL."""
    store = FileKeystore(tmp_path / "keyring.json")
    create_ring(store, key_format="mk1")
    return store, f"sqlite:///{tmp_path / 'audit.db'}"


def test_begin_refuses_an_mk2_key_while_a_live_instance_cannot_read_it(fleet: tuple[FileKeystore, str]) -> None:
    store, url = fleet
    ring = store.load()
    audit = open_store(url)
    audit.put_instance(_instance("old-pod", ring.ring_id, "0.1.9").row())
    audit.put_instance(_instance("new-pod", ring.ring_id, "0.2.0").row())
    audit.put_instance(_instance("crashed-old", ring.ring_id, "0.1.0", age=31).row())  # stale: not counted
    audit.put_instance(_instance("stopped-old", ring.ring_id, "0.1.0", state=STOPPED).row())
    audit.put_instance(_instance("other-ring-old", "r-0000000000000000", "0.1.0").row())
    old = instances_that_cannot_read(audit, ring, [KEY_FORMAT_MK2], utcnow())
    assert [(u.instance.name, u.features) for u in old] == [("old-pod", (KEY_FORMAT_MK2,))]

    check = readers_check_for(store, audit=url, what="rotate begin", instead="make an mk1 key: --key-format mk1")
    with pytest.raises(NotYet) as refused:
        run_step(store, "begin", check=check)
    message = str(refused.value)
    assert message.startswith("rotate begin not written: 1 live instance(s) run a release that cannot read it")
    assert "old-pod (version 0.1.9, cannot read: key format mk2)" in message
    assert "new-pod" not in message and "crashed-old" not in message and "--key-format mk1" in message
    assert store.load() == ring  # nothing written

    assert run_step(store, "begin", check=check, key_format="mk1").ring.keys[-1].format is KeyFormat.MK1
    audit.put_instance(_instance("old-pod", ring.ring_id, "0.2.0").row())  # upgraded
    apply_change(store, "abort", abort)  # (a second begin would be a no-op)
    began = run_step(store, "begin", check=check)
    assert began.ring.keys[-1].format is KeyFormat.MK2
    # Once the ring holds an mk2 key, the next ring holds nothing new: nothing to check.
    audit.put_instance(_instance("old-pod", ring.ring_id, "0.1.9").row())
    assert run_step(store, "promote", check=check).changed


@pytest.mark.e2e
def test_the_cli_exits_75_naming_the_old_instance(fleet: tuple[FileKeystore, str]) -> None:
    store, url = fleet
    audit = open_store(url)
    audit.put_instance(_instance("billing-7d9f", store.load().ring_id, "0.1.4").row())
    env = {"MRTR_KEYS_AUDIT": url}
    res = run_cli("rotate", "begin", keystore=store.path, env=env)
    assert res.code == 75, res.err
    assert "billing-7d9f (version 0.1.4, cannot read: key format mk2)" in res.err
    assert "\n" not in res.err.strip() and "Traceback" not in res.err
    ok = run_cli("rotate", "begin", "--key-format", "mk1", "--json", keystore=store.path, env=env)
    assert ok.code == 0, ok.err
    assert ok.json()["format"] == "mk1"
