"""A key ring on a read-only mount: a Kubernetes Secret volume as the kubelet lays it out.

The kubelet writes Secret files ``root:fsGroup`` with ``defaultMode`` (0440 for a non-root reader) behind
a ``..data`` link it swaps atomically. Such files are accepted (nobody can chmod them there), world-readable
ones are still refused, nothing is ever written to the mount, and the state directory is never on it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mrtr_keys.changes.rotation import run_step
from mrtr_keys.errors import ConfigError, KeystoreError
from mrtr_keys.keystores import open_keystore
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.keystores.mounted import MountedKeystore
from mrtr_keys.service.clients import add_client, load_registry
from tests.fixtures.common import run_cli
from tests.fixtures.keyrings import fresh_ring
from tests.fixtures.keystores import kubelet_publish


def publish(mount: Path, ring_bytes: bytes, mode: int = 0o440) -> str:
    return kubelet_publish(mount, {"keyring.json": ring_bytes}, mode=mode)


def test_a_kubelet_mount_opens_read_only_with_0440_files(kubelet_mount: Path, tmp_path: Path) -> None:
    ring = fresh_ring()
    publish(kubelet_mount, ring.dumps())
    store = open_keystore(kubelet_mount / "keyring.json", state_dir=tmp_path / "state")
    assert isinstance(store, MountedKeystore)
    assert stat.S_IMODE(os.stat(kubelet_mount / "keyring.json").st_mode) == 0o440
    assert store.load() == ring
    assert store.directory == tmp_path / "state"


def test_a_world_readable_file_is_refused_even_on_a_mount(kubelet_mount: Path) -> None:
    publish(kubelet_mount, fresh_ring().dumps(), mode=0o444)
    with pytest.raises(KeystoreError, match=r"open to others.*\(mode 0444\).*defaultMode: 0440") as info:
        open_keystore(kubelet_mount / "keyring.json").load()
    assert "\n" not in str(info.value)


def test_a_write_is_refused_naming_where_writes_go(kubelet_mount: Path, tmp_path: Path) -> None:
    publish(kubelet_mount, fresh_ring().dumps())
    path = kubelet_mount / "keyring.json"
    r = run_cli("rotate", "begin", keystore=path, env={"MRTR_KEYS_STATE_DIR": str(tmp_path / "state")})
    assert r.code == 1
    assert r.err.startswith(f"mrtr-keys: key ring {path} is on a read-only mount; nothing was written: writes go to")
    assert "--keystore" in r.err and "update the Secret" in r.err and len(r.err.splitlines()) == 1
    assert open_keystore(path).load().generation == 1


def test_revision_is_the_data_link_and_follows_each_swap(kubelet_mount: Path) -> None:
    source = FileKeystore(kubelet_mount.parent / "source" / "keyring.json")
    source.create(fresh_ring())
    first = publish(kubelet_mount, source.path.read_bytes())
    store = open_keystore(kubelet_mount / "keyring.json")
    assert store.revision() == f"data:{first}"  # type: ignore[attr-defined]
    for step in ("begin", "promote"):
        run_step(source, step)
        stamp = publish(kubelet_mount, source.path.read_bytes())
        assert store.revision() == f"data:{stamp}"  # type: ignore[attr-defined]
        assert store.load() == source.load()
    assert sorted(p.name for p in kubelet_mount.iterdir() if p.name.startswith("..2")) == [stamp]


def test_the_state_directory_is_never_the_mount(kubelet_mount: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    publish(kubelet_mount, fresh_ring().dumps())
    with pytest.raises(ConfigError, match=r"is on the read-only mount.*emptyDir"):
        _ = open_keystore(kubelet_mount / "keyring.json", state_dir=kubelet_mount).directory
    monkeypatch.delenv("MRTR_KEYS_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(kubelet_mount.parent / "xdg"))
    directory = open_keystore(kubelet_mount / "keyring.json").directory
    assert directory.parent == kubelet_mount.parent / "xdg" / "mrtr-keys" and directory.is_dir()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_a_writable_ring_file_keeps_its_state_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As before the state directory existed: audit key, audit log and registry beside a writable ring."""
    monkeypatch.delenv("MRTR_KEYS_STATE_DIR", raising=False)
    path = tmp_path / "ring" / "keyring.json"
    assert open_keystore(path).directory == path.parent
    assert open_keystore(path, state_dir=tmp_path / "state").directory == tmp_path / "state"
    monkeypatch.setenv("MRTR_KEYS_STATE_DIR", str(tmp_path / "env-state"))
    assert open_keystore(path).directory == tmp_path / "env-state"


def test_a_client_registry_on_the_mount_is_read_with_the_same_rule(kubelet_mount: Path, tmp_path: Path) -> None:
    made = tmp_path / "made" / "clients.json"
    add_client(made, "billing", audiences=["billing"])
    kubelet_publish(kubelet_mount, {"clients.json": made.read_bytes()})
    assert [c.name for c in load_registry(kubelet_mount / "clients.json")] == ["billing"]
    kubelet_publish(kubelet_mount, {"clients.json": made.read_bytes()}, mode=0o444)
    with pytest.raises(KeystoreError, match="open to others"):
        load_registry(kubelet_mount / "clients.json")


def test_a_symlink_leaving_the_mount_is_refused(kubelet_mount: Path, tmp_path: Path) -> None:
    publish(kubelet_mount, fresh_ring().dumps())
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes(fresh_ring().dumps())
    outside.chmod(0o400)
    (kubelet_mount / "other.json").symlink_to(outside)
    with pytest.raises(KeystoreError, match="leaves its mount"):
        open_keystore(kubelet_mount / "other.json").load()


def test_a_revocation_published_to_the_mount_is_refused_within_3_s_of_the_swap(
    kubelet_mount: Path, tmp_path: Path
) -> None:
    """Issue 37 on a mounted Secret: the ring is revoked at its source and the kubelet publishes it (its own
    sync comes first, up to a minute in a cluster); from the swap, a codec at the default 2 s check interval
    refuses the revoked kid's tokens (`revoked kid`) within 3 s, and seals with the new primary."""
    import time

    from mcp.server.mcpserver import InvalidRequestState

    from mrtr_keys.backends import backend_for
    from mrtr_keys.changes.apply import apply_change
    from mrtr_keys.changes.revoke import revoke
    from mrtr_keys.factory import open_codec
    from tests.support.lateness import Relay

    source = FileKeystore(kubelet_mount.parent / "source" / "keyring.json")
    source.create(fresh_ring())
    publish(kubelet_mount, source.path.read_bytes())
    mounted = open_keystore(kubelet_mount / "keyring.json", state_dir=tmp_path / "state")
    codec = open_codec(mounted, audience="svc")  # the library's defaults: a check every 2 s (+-20 %)
    kid = codec.ring.primary.kid  # type: ignore[attr-defined]
    token = codec.seal(b"in flight")
    apply_change(
        source, "revoke", lambda r, at: revoke(r, kid, at, reason="leak", by="ops", backend=backend_for(r.codec))
    )
    with Relay() as relay:
        publish(kubelet_mount, source.path.read_bytes())  # the kubelet's swap of ..data
        swapped = time.monotonic()
        while codec.ring.primary.kid == kid:  # type: ignore[attr-defined]
            assert time.monotonic() - swapped < 3.0 + relay.overrun, "not reloaded within 3 s of the swap"
            time.sleep(0.02)
    with pytest.raises(InvalidRequestState, match="revoked kid"):
        codec.unseal(token)
    assert codec.unseal(codec.seal(b"next")) == b"next"
    codec.watcher.stop()  # type: ignore[attr-defined]
