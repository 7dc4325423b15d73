"""Small things that confused a new user (issue 23), each as the user meets it.

* ``init --keystore vault-kv:/secret/x`` (one slash) or ``aws-sm:name`` is refused with the right spelling,
  and nothing is created (it used to make a local ring under a directory named ``vault-kv:``).
* ``fleet status`` answers from presence alone when the keystore cannot be read (a note, exit 0).
* A long presence note is wrapped in 80 columns, never cut mid-word.
* A ``vault-kv://`` URL whose first segment is no mount says how to enable a KV version 2 engine there.
* ``--wait`` takes a duration (``15m``) like ``--if-older-than``; with ``MRTR_KEYS_LOG_FORMAT=json`` its
  progress lines are JSON objects.
* ``clients list`` with no clients says how to add one; a server ``ttl`` above the ring's gets one advice
  (``keys ttl``), from the library codec and the sidecar client alike.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import mrtr_keys
from tests.fixtures.audit import cli
from tests.fixtures.common import run_cli


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("vault-kv:/secret/x", "vault-kv://secret/x"),
        ("vault-kv:secret/x", "vault-kv://secret/x"),
        ("aws-sm:mrtr/keyring", "aws-sm://mrtr/keyring"),
        ("file:ring.json", "file:///ring.json"),
    ],
)
def test_a_known_scheme_without_slashes_is_refused_with_the_right_spelling(
    tmp_path: Path, typed: str, meant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    res = cli("init", "--keystore", typed)
    assert res.code == 2 or res.code == 1, res.out
    assert f"did you mean {meant!r}" in res.err and "Traceback" not in res.err
    assert len(res.err.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []  # no directory named "vault-kv:" (or anything else)


def test_fleet_status_answers_from_presence_when_the_keystore_cannot_be_read(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    codec = mrtr_keys.request_state_security(ring, audience="svc", instance="svc-1").codec
    assert codec.presence.beat()  # type: ignore[attr-defined]
    ring.rename(tmp_path / "moved.json")  # the keystore is out of reach; the audit store is not
    res = cli("fleet", "status", keystore=ring)
    assert res.code == 0, res.err
    assert "svc-1" in res.out and "live" in res.out
    assert "keystore: no key ring at" in res.out and "every ring" in res.out
    res = cli("fleet", "status", "--json", keystore=ring)
    assert res.code == 0 and [r["name"] for r in res.json()] == ["svc-1"]
    assert "keystore:" in res.err
    codec.presence.stop()  # type: ignore[attr-defined]


def test_a_long_note_is_wrapped_in_80_columns_not_cut(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    codec = mrtr_keys.request_state_security(ring, audience="svc", instance="svc-2").codec
    note = (
        "keystore: cannot reach Vault at https://vault.internal:8200: connection refused; check VAULT_ADDR/BAO_ADDR "
        "and that the server is up, and that this pod's network policy lets it reach the Vault service on 8200"
    )
    codec.reload_refused = note  # type: ignore[attr-defined]
    assert codec.presence.beat()  # type: ignore[attr-defined]
    res = cli("fleet", "status", keystore=ring)
    assert res.code == 0, res.err
    assert all(len(line) <= 80 for line in res.out.splitlines())
    assert " ".join(res.out.split()).endswith(" ".join(f"svc-2: refused a ring: {note}".split()))
    codec.presence.stop()  # type: ignore[attr-defined]


def test_a_vault_kv_url_without_a_mount_says_how_to_enable_one(bao_env: dict[str, str], tmp_path: Path) -> None:
    url = f"vault-kv://nomount-{tmp_path.name[-12:]}/mrtr/keyring"
    res = cli("init", "--keystore", url)
    assert res.code != 0 and "Traceback" not in res.err
    assert "there is no secrets engine mounted at" in res.err
    assert "secrets enable -path=nomount-" in res.err and "kv-v2" in res.err
    res = cli("rotate", "status", "--keystore", url)
    assert "there is no secrets engine mounted at" in res.err


def test_wait_takes_a_duration_and_its_progress_is_json_with_the_json_log_format(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    stuck = mrtr_keys.request_state_security(ring, audience="svc", reload_every=0, instance="stuck").codec
    assert cli("rotate", "begin", keystore=ring).code == 0
    res = run_cli("rotate", "promote", "--wait", "0.03m", keystore=ring, env={"MRTR_KEYS_LOG_FORMAT": "json"})
    assert res.code == 75, res.err
    lines = res.err.strip().splitlines()
    progress = [json.loads(line) for line in lines[:-1]]  # every line but the final refusal is a JSON object
    assert progress and {"time", "level", "logger", "message", "pid", "step", "seconds_left"} <= set(progress[0])
    assert progress[0]["step"] == "promote" and "instances ready 0 of 1" in progress[0]["message"]
    assert 0 < progress[0]["seconds_left"] <= 1.8
    bad = run_cli("rotate", "promote", "--wait", "soon", keystore=ring)
    assert bad.code == 2 and "--wait must be a duration such as" in bad.err
    stuck.presence.stop()  # type: ignore[attr-defined]


def test_clients_list_with_no_clients_says_how_to_add_one(tmp_path: Path) -> None:
    ring = tmp_path / "keyring.json"
    assert cli("init", keystore=ring).code == 0
    res = cli("clients", "list", keystore=ring)
    assert res.code == 0
    registry = tmp_path / "clients.json"
    assert res.out.strip() == (
        f"no sidecar clients in {registry}; add one with: mrtr-keys clients add NAME --audience AUDIENCE"
    )
    assert cli("clients", "list", "--json", keystore=ring).json() == {"clients": []}


def test_a_server_ttl_above_the_rings_gives_one_advice_library_and_sidecar_alike(tmp_path: Path) -> None:
    from mrtr_keys.codecs.sidecar_client import sidecar_security
    from mrtr_keys.errors import ConfigError
    from mrtr_keys.service.clients import add_client
    from tests.fixtures.sidecar import start_sidecar

    ring = tmp_path / "keyring.json"
    assert cli("init", "--audience", "svc", keystore=ring).code == 0
    advice = "raise the ring's TTL (at once, no rotation) with: mrtr-keys keys ttl SECONDS"
    with pytest.raises(ConfigError, match=re.escape(advice)):
        mrtr_keys.request_state_security(ring, audience="svc", ttl=1200, audit=False, reload_every=0)
    _, secret = add_client(tmp_path / "clients.json", "web", audiences=["svc"], ops=["seal", "unseal"])
    sidecar = start_sidecar(ring, workdir=tmp_path / "sc")
    try:
        with pytest.raises(ConfigError, match=re.escape(advice)):
            sidecar_security(sidecar.url, audience="svc", secret=secret, ttl=1200)
    finally:
        sidecar.stop()
