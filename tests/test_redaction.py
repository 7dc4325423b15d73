"""No credential in any error text (issue 22, deliver 7): passwords with ``%``, ``@``, ``:`` and non-ASCII,
percent-encoded or not, in every store URL; the CLI's one-line errors, store errors, log lines, the
sidecar's unauthenticated ``/readyz`` and ``--replay-store`` given through ``MRTR_KEYS_REPLAY_STORE``."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest

from mrtr_keys.errors import ReplayStoreUnavailable
from mrtr_keys.logs import JsonFormatter, ScrubbingFormatter
from mrtr_keys.replay.store import open_store as open_replay_store
from mrtr_keys.urls import redact, scrub
from tests.fixtures.audit import cli
from tests.fixtures.codec_contract import ring_secrets
from tests.support.net import refused_port
from tests.support.proxy import CountingProxy

# (as written in the URL, the secret as a human would type it)
PASSWORDS = [
    ("Pw%Secret-1", "Pw%Secret-1"),  # a bare "%": libpq echoes it in its "invalid percent-encoded token"
    ("p%40ss%3Aw%C3%B6rd-9", "p@ss:wörd-9"),  # "@", ":" and "ö" percent-encoded
    ("s%C3%AAcret-2x", "sêcret-2x"),
]


def _secret_free(text: str, written: str, plain: str) -> None:
    assert written not in text and plain not in text, text


@pytest.mark.parametrize(("written", "plain"), PASSWORDS)
def test_the_cli_never_prints_an_audit_store_password(written: str, plain: str, tmp_path: Path) -> None:
    with refused_port() as port:
        for url in (
            f"postgresql://mrtr:{written}@127.0.0.1:{port}/audit",
            f"postgresql://mrtr:{written}@[::1/x/audit",  # a host libpq cannot parse
            f"postgresql://127.0.0.1:{port}/audit?user=mrtr&password={written}",
        ):
            result = cli("audit", "query", "--audit", url, keystore=tmp_path / "keyring.json")
            assert result.code != 0
            _secret_free(result.out + result.err, written, plain)
            assert "mrtr-keys:" in result.err  # one line, not a traceback


@pytest.mark.parametrize(("written", "plain"), PASSWORDS)
def test_replay_store_errors_never_carry_the_password(written: str, plain: str) -> None:
    with refused_port() as port:
        for url in (f"redis://:{written}@127.0.0.1:{port}/0", f"postgresql://mrtr:{written}@127.0.0.1:{port}/db"):
            store = open_replay_store(url)
            with pytest.raises(ReplayStoreUnavailable) as info:
                store.consume(b"\x00" * 16, 1000)
            _secret_free(str(info.value) + repr(store), written, plain)
            store.close()


def test_log_lines_are_scrubbed_in_both_formats() -> None:
    url = "postgresql://mrtr:Log-Secret%3A7@db.internal:5432/audit"
    redact(url)  # the process was given this URL
    record = logging.LogRecord("mrtr_keys.audit", logging.WARNING, __file__, 1, "failed: %s", ("Log-Secret:7",), None)
    for formatter in (ScrubbingFormatter("%(message)s"), JsonFormatter()):
        line = formatter.format(record)
        assert "Log-Secret" not in line and "***" in line
    assert scrub(f"connect {url} failed") == "connect postgresql://mrtr:***@db.internal:5432/audit failed"


def test_serve_reads_the_replay_store_from_the_environment(
    keystore_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MRTR_KEYS_REPLAY_STORE", "memcached://pay:Env-Secret%40x@127.0.0.1:1/0")
    with refused_port() as port:  # taken: serve could never start serving, whatever happens
        result = cli("serve", "--port", str(port), keystore=keystore_path)
    assert result.code == 2
    assert "replay store" in result.err
    _secret_free(result.out + result.err, "Env-Secret%40x", "Env-Secret@x")


def test_a_sidecar_whose_stores_are_down_shows_no_password_or_key_anywhere(
    keystore_path: Path,
    tmp_path: Path,
    sidecar_factory: Any,
    pg_fault_proxy: tuple[CountingProxy, str],
) -> None:
    """Both store URLs carry the password (in the config file, as docs/sidecar.md shows; trust auth ignores
    it); the audit store is cut after the start, the replay store refuses connections. The password is not
    in ``/readyz`` (anonymous or authenticated: the error text goes to an authenticated caller, redacted),
    ``/metrics``, an answer, the log, nor the environment or command line of the sidecar or its children
    (the audit writer child). Nor is any key material (issue 39): the ring's keys, the audit key and the
    client's secret appear in none of those, nor in any file of the state directory but the one that keeps
    each (the ring file; ``audit.key``; the registry keeps only a hash of the secret)."""
    # "@", ":" and non-ASCII, percent-encoded (a bare "%" cannot start: libpq refuses the URL, the CLI test above);
    # not a parameter: the sidecar's environment holds PYTEST_CURRENT_TEST, the test's id
    written, plain = PASSWORDS[1]
    proxy, url = pg_fault_proxy
    audit = url.replace("@", f":{written}@", 1)
    with refused_port() as port:
        cfg = tmp_path / "sidecar.toml"
        cfg.write_text(
            "[sidecar]\n"
            f'audit = "{audit}"\n'
            f'replay_store = "redis://:{written}@127.0.0.1:{port}/0"\n'
            'single_use_audiences = ["svc"]\n'
        )
        side = sidecar_factory(keystore_path, extra=["--config", str(cfg)])
        secret = side.add_client("pay", ["svc"])
        anon, authed = side.http(), side.http(secret)
        proxy.stop()
        deadline = time.monotonic() + 15
        while set(anon.get("/readyz").json().get("down", {})) != {"audit", "replay"}:
            assert time.monotonic() < deadline, anon.get("/readyz").text
            authed.post("/v1/seal", json={"audience": "svc", "payload": "AAAA"})  # an audit write to fail
            time.sleep(0.2)
        token = authed.post("/v1/seal", json={"audience": "svc", "payload": "AAAA"}).json()["token"]
        texts = {
            "/readyz": anon.get("/readyz").text,
            "/readyz (authenticated)": authed.get("/readyz").text,
            "/readyz?strict=true": anon.get("/readyz?strict=true").text,
            "/metrics": anon.get("/metrics").text,
            "unseal": authed.post("/v1/unseal", json={"audience": "svc", "token": token}).text,
        }
        pids = [side.proc.pid, *_descendants(side.proc.pid)]
        for pid in pids:
            for what in ("environ", "cmdline"):
                texts[f"/proc/{pid}/{what}"] = Path(f"/proc/{pid}/{what}").read_bytes().decode(errors="replace")
        side.stop()
        texts["log"] = side.output()
    assert '"error"' in texts["/readyz (authenticated)"]  # the store errors are there, redacted
    assert len(pids) >= 2  # the writer child was looked at too
    assert "***" in texts["log"]  # the stores' errors were logged, redacted
    for where, text in texts.items():
        assert written not in text and plain not in text, where
    audit_key = (keystore_path.parent / "audit.key").read_bytes()
    keys = {"ring": ring_secrets(keystore_path), "audit key": _encodings(audit_key), "client secret": (secret,)}
    kept = {"ring": keystore_path.name, "audit key": "audit.key"}
    files = {
        f"state dir: {p.name}": p.read_bytes().decode("latin-1") for p in keystore_path.parent.rglob("*") if p.is_file()
    }
    for what, forms in keys.items():
        for where, text in {**texts, **files}.items():
            if where != f"state dir: {kept.get(what)}":
                assert not any(form in text for form in forms), (what, where)


def _encodings(key: bytes) -> tuple[str, ...]:
    """`key` as a secret sweep looks for it: raw, hex, standard and urlsafe base64."""
    import base64

    return (
        key.decode("latin-1"),
        key.hex(),
        base64.b64encode(key).decode(),
        base64.urlsafe_b64encode(key).decode().rstrip("="),
    )


def _descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for child in children for c in (child, *map(str, _descendants(int(child))))]


def test_a_checkpoint_record_carries_no_password_however_the_query_spells_its_name(
    postgres_url: str, tmp_path: Path, audit_key: bytes
) -> None:
    """libpq decodes a query parameter's name too, so ``?pass%77ord=`` is its password: the URL a
    checkpoint records (``store``) must not keep it (it is written to a file, not scrubbed)."""
    cps = tmp_path / "cp.jsonl"
    url = postgres_url + "?application_name=mrtr&pass%77ord=Enc0ded-pw%21"  # trust auth: not checked
    res = cli("audit", "checkpoint", "--audit", url, "--checkpoints", str(cps), "--json")
    assert res.code == 0, res.err
    for text in (cps.read_text(), res.out, res.err):
        _secret_free(text, "Enc0ded-pw%21", "Enc0ded-pw!")
    assert '"store":"' + postgres_url + '?application_name=mrtr&pass%77ord=***"' in cps.read_text()


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://127.0.0.1:1/audit?password=Raw-pw%46x",  # scrubbed as written, not only decoded
        "postgresql://mrtr@[::1/audit?password=Raw-pw%46x",  # a netloc urlparse refuses
    ],
)
def test_a_percent_encoded_query_password_is_redacted_as_written(url: str) -> None:
    assert "Raw-pw" not in redact(url) and "password=***" in redact(url)
    assert "Raw-pw" not in scrub(f"cannot connect to {url}: Raw-pw%46x / Raw-pwFx")
