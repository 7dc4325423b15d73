"""No credential in any error text (issue 22, deliver 7): passwords with ``%``, ``@``, ``:`` and non-ASCII,
percent-encoded or not, in every store URL; the CLI's one-line errors, store errors, log lines, the
sidecar's unauthenticated ``/readyz`` and ``--replay-store`` given through ``MRTR_KEYS_REPLAY_STORE``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mrtr_keys.errors import ReplayStoreUnavailable
from mrtr_keys.logs import JsonFormatter, ScrubbingFormatter
from mrtr_keys.replay.store import open_store as open_replay_store
from mrtr_keys.urls import redact, scrub
from tests.fixtures.audit import cli
from tests.support.net import refused_port

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
