"""The file keystore : atomic writes (temp file, fsync, rename), mode 0600,
refuses group/world-readable files (as ssh refuses such a private key), never overwrites on
create, and compare-and-swap on the generation so two writers can never both win."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mrtr_keys.changes import scope as audience
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.errors import ConflictError, KeyRingError, KeyRingExists, KeyRingNotFound, KeystoreError
from mrtr_keys.keystores import open_keystore
from mrtr_keys.keystores.file import FileKeystore
from tests.fixtures.keyrings import BadRing, bad_rings, fresh_ring, write_ring_doc

BAD = bad_rings()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_create_writes_a_0600_file_even_under_a_permissive_umask(tmp_path: Path) -> None:
    store = FileKeystore(tmp_path / "sub" / "ring.json")
    old = os.umask(0)
    try:
        ring = fresh_ring()
        store.create(ring)
    finally:
        os.umask(old)
    assert mode(store.path) == 0o600
    assert store.load() == ring
    assert leftovers(store.path.parent) == []


def test_save_replaces_atomically_and_keeps_0600(keystore: FileKeystore) -> None:
    ring = keystore.load()
    after = ring.next_generation(audiences=("billing",))
    keystore.save(after, expected_generation=ring.generation)
    assert keystore.load() == after and mode(keystore.path) == 0o600
    assert leftovers(keystore.path.parent) == []


def test_create_refuses_to_overwrite(keystore: FileKeystore) -> None:
    before = keystore.path.read_bytes()
    with pytest.raises(KeyRingExists, match="never overwritten"):
        keystore.create(fresh_ring())
    with pytest.raises(KeyRingExists):
        create_ring(keystore)
    assert keystore.path.read_bytes() == before


@pytest.mark.parametrize("stale", [0, 1, 5])
def test_save_with_a_stale_generation_is_a_conflict_and_writes_nothing(keystore: FileKeystore, stale: int) -> None:
    ring = keystore.load()
    current = ring.next_generation(audiences=("a",))
    keystore.save(current, expected_generation=1)  # now generation 2
    before = keystore.path.read_bytes()
    with pytest.raises(ConflictError, match="nothing was written") as info:
        keystore.save(ring.next_generation(audiences=("b",)), expected_generation=stale)
    assert "run the command again" in str(info.value)
    assert keystore.path.read_bytes() == before
    assert keystore.load() == current


def test_save_must_raise_the_generation(keystore: FileKeystore) -> None:
    ring = keystore.load()
    with pytest.raises(ConflictError):
        keystore.save(ring, expected_generation=ring.generation)


def test_a_failed_write_leaves_the_old_ring_as_it_was(keystore: FileKeystore) -> None:
    """A write that fails midway (here: the file size limit, RLIMIT_FSIZE, hit while writing the temp
    file; it works for root too, unlike a read-only directory) leaves the old file and no temp file."""
    before = keystore.path.read_bytes()
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "from mrtr_keys.keystores.file import FileKeystore\n"
        "from mrtr_keys.changes.rotation import run_step\n"
        "from mrtr_keys.errors import KeystoreError\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))\n"
        "try:\n"
        "    run_step(FileKeystore(sys.argv[1]), 'begin')\n"
        "except KeystoreError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(keystore.path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 3, proc.stderr
    assert "cannot write key ring" in proc.stdout and "the old ring is unchanged" in proc.stdout
    assert keystore.path.read_bytes() == before
    assert keystore.load().generation == 1
    assert leftovers(keystore.path.parent) == []


@pytest.mark.parametrize("bad", BAD, ids=[b.id for b in BAD])
def test_bad_rings_fail_to_load_with_one_line_and_no_material(tmp_path: Path, bad: BadRing) -> None:
    path = write_ring_doc(tmp_path / "ring.json", bad.doc, mode=bad.mode)
    with pytest.raises((KeyRingError, KeystoreError)) as info:
        FileKeystore(path).load()
    message = str(info.value)
    assert bad.expect in message and "\n" not in message
    for material in bad.material:
        assert material not in message


def test_an_unsafe_mode_error_says_how_to_fix_it(tmp_path: Path) -> None:
    path = write_ring_doc(tmp_path / "ring.json", fresh_ring().to_json(), mode=0o644)
    with pytest.raises(KeystoreError, match=f"fix with: chmod 600 {path}"):
        FileKeystore(path).load()
    os.chmod(path, 0o600)
    FileKeystore(path).load()


def test_a_missing_ring_names_init(tmp_path: Path) -> None:
    with pytest.raises(KeyRingNotFound, match="mrtr-keys init") as info:
        FileKeystore(tmp_path / "nope.json").load()
    assert info.value.exit_code == 2


def test_a_symlink_or_directory_is_not_a_ring(tmp_path: Path, keystore: FileKeystore) -> None:
    link = tmp_path / "link.json"
    link.symlink_to(keystore.path)
    with pytest.raises(KeystoreError):
        FileKeystore(link).load()
    folder = tmp_path / "dir.json"
    folder.mkdir(mode=0o700)
    with pytest.raises(KeystoreError, match="not a regular file"):
        FileKeystore(folder).load()


def test_open_keystore_takes_a_path_or_a_file_url(keystore: FileKeystore) -> None:
    assert open_keystore(str(keystore.path)).load() == keystore.load()
    assert open_keystore(keystore.url).load() == keystore.load()
    assert keystore.url.startswith("file:///")


def test_threads_sharing_one_keystore_serialise_their_changes(keystore: FileKeystore) -> None:
    """The lock is re-entrant per thread, not per object: eight threads adding eight audiences
    through one FileKeystore all succeed, one generation each."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def add(name: str) -> None:
        barrier.wait()
        try:
            audience.add(keystore, name)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(f"aud-{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ring = keystore.load()
    assert sorted(ring.audiences) == [f"aud-{i}" for i in range(8)] and ring.generation == 9


def test_run_step_reads_and_writes_through_the_keystore(keystore: FileKeystore) -> None:
    result = run_step(keystore, "begin")
    assert keystore.load() == result.ring and mode(keystore.path) == 0o600


def test_a_writer_gives_up_on_a_held_lock_with_exit_75_and_changes_nothing(tmp_path: Path) -> None:
    """Our decision: a stuck run never hangs a deploy step; after MRTR_KEYS_LOCK_TIMEOUT it is 'retry later'."""
    import fcntl

    from tests.fixtures.common import run_cli

    path = tmp_path / "keyring.json"
    create_ring(FileKeystore(path))
    with open(str(path) + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        r = run_cli("audience", "add", "billing", keystore=path, env={"MRTR_KEYS_LOCK_TIMEOUT": "0.3"})
    assert r.code == 75, r.err
    assert "locked by another run" in r.err and len(r.err.strip().splitlines()) == 1
    assert FileKeystore(path).load().audiences == ()


def test_a_deeply_nested_ring_is_a_one_line_load_error(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    path.write_text("[" * 100_000)
    path.chmod(0o600)
    with pytest.raises(KeyRingError, match="nested too deeply"):
        FileKeystore(path).load()
