"""Two processes racing on one keystore: 50 rotation steps each, every lost race retried.

Compare-and-swap is the keystore's own (Vault KV ``cas``, moving Secrets Manager's AWSCURRENT off
the version read, the file's lock), and each process has its own state directory, so nothing local
serialises them. Afterwards: generation 101, every generation 2..101 written by exactly one process
(no lost update, no duplicate, no gap), every ring a process committed readable as it committed it
(from the store's version history where it keeps one), and a reader that loaded the ring all along
never saw an invalid ring or a generation going back.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import boto3
import pytest

from mrtr_keys.changes.create import create_ring
from mrtr_keys.keystores import open_keystore
from mrtr_keys.ring.document import parse_ring
from tests.fixtures.keystores import KeystoreUnderTest
from tests.fixtures.moto_kms import REGION
from tests.fixtures.openbao import OpenBao

pytestmark = pytest.mark.e2e

STEPS = 50
WRITER = """
import hashlib, json, sys
from mrtr_keys.errors import ConflictError
from mrtr_keys.keystores import open_keystore
from mrtr_keys.changes.rotation import run_step

url, state, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
store = open_keystore(url, state_dir=state)
done, conflicts = [], 0
while len(done) < steps:
    try:
        result = run_step(store, "next", force=True)
    except ConflictError:
        conflicts += 1
        continue
    done.append([result.ring.generation, hashlib.sha256(result.ring.dumps()).hexdigest()])
with open(out, "w") as f:
    json.dump({"committed": done, "conflicts": conflicts}, f)
"""


def test_two_writers_fifty_steps_each(any_keystore: KeystoreUnderTest, tmp_path: Path, request: object) -> None:
    ks = any_keystore
    store = ks.open()
    create_ring(store)
    if ks.kind == "vault-kv":  # keep every version for the check below (KV v2 keeps 10 by default)
        bao: OpenBao = request.getfixturevalue("openbao")  # type: ignore[attr-defined]
        bao.api("POST", f"secret/metadata/{ks.url.split('/', 3)[3]}", {"max_versions": 200})

    seen: list[int] = []
    reader_errors: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        reading = open_keystore(ks.url, state_dir=tmp_path / "reader")
        while not stop.is_set():
            try:
                seen.append(reading.load().generation)
            except Exception as exc:
                reader_errors.append(f"{type(exc).__name__}: {exc}")
            stop.wait(0.01)

    thread = threading.Thread(target=reader)
    thread.start()
    env = {**os.environ, **ks.env}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER,
                ks.url,
                str(tmp_path / f"state-{i}"),
                str(STEPS),
                str(tmp_path / f"{i}.json"),
            ],
            env=env,
        )
        for i in range(2)
    ]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        stop.set()
        thread.join(timeout=30)
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0]
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    committed = {g: h for r in results for g, h in r["committed"]}
    generations = sorted(g for r in results for g, _ in r["committed"])
    assert generations == list(range(2, 2 + 2 * STEPS))  # no duplicate, no gap
    final = store.load()
    assert final.generation == 1 + 2 * STEPS
    assert len(final.keys) == 1 + (2 * STEPS + 2) // 3  # one key per begin: no step lost
    assert reader_errors == [] and len(seen) > 0 and seen == sorted(seen)

    history = _history(ks, request)
    if history is not None:
        for generation, digest in committed.items():
            assert digest in history.get(generation, set()), generation
    conflicts = [r["conflicts"] for r in results]
    print(f"\n{ks.kind}: {2 * STEPS} steps, conflicts retried per process {conflicts}, reader loads {len(seen)}")


def _history(ks: KeystoreUnderTest, request: object) -> dict[int, set[str]] | None:
    """generation -> digests of every stored version (None for a file: it keeps no history)."""
    out: dict[int, set[str]] = {}

    def add(text: str) -> None:
        ring = parse_ring(text)
        out.setdefault(ring.generation, set()).add(hashlib.sha256(ring.dumps()).hexdigest())

    if ks.kind == "vault-kv":
        bao: OpenBao = request.getfixturevalue("openbao")  # type: ignore[attr-defined]
        path = ks.url.split("/", 3)[3]
        for version in range(1, 2 + 2 * STEPS):
            data = bao.api("GET", f"secret/data/{path}?version={version}")["data"]
            add(data["data"]["keyring"])  # type: ignore[index]
        assert set(out) == set(range(1, 2 + 2 * STEPS))  # version n holds generation n
        return out
    if ks.kind == "aws-sm":
        kms = request.getfixturevalue("kms")  # type: ignore[attr-defined]
        sm = boto3.client(
            "secretsmanager",
            endpoint_url=kms.moto_url,
            region_name=REGION,
            aws_access_key_id="t",
            aws_secret_access_key="t",
        )
        name = ks.url.split("://", 1)[1]
        versions = sm.list_secret_version_ids(SecretId=name, IncludeDeprecated=True)["Versions"]
        for v in versions:
            add(sm.get_secret_value(SecretId=name, VersionId=v["VersionId"])["SecretString"])
        previous = sm.get_secret_value(SecretId=name, VersionStage="AWSPREVIOUS")["SecretString"]
        assert parse_ring(previous).generation == 2 * STEPS  # AWSPREVIOUS: the ring before the last
        return out
    return None
