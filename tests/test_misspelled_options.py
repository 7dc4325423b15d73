"""A misspelled option is an error (issue 39, item 6): every entry point that takes options on behalf of a codec,
keystore or backend refuses a keyword none of them takes with `ConfigError`, naming the keyword and the closest
one it does take, before it opens anything. Before, ``request_state_security(..., reload_evry=3)`` was accepted
and silently ignored, so a typo in a security setting went unseen."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import mrtr_keys
from mrtr_keys.backends import backend_for
from mrtr_keys.changes.create import create_ring
from mrtr_keys.codecs.sidecar_client import sidecar_security
from mrtr_keys.errors import ConfigError
from mrtr_keys.keystores.file import FileKeystore

AUD = "billing"
SIDECAR = "http://127.0.0.1:9"  # never reached: the keyword is refused first


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.mark.parametrize(
    ("call", "typo", "closest"),
    [
        (lambda p, **kw: mrtr_keys.request_state_security(p, audience=AUD, **kw), "reload_evry", "reload_every"),
        (lambda p, **kw: mrtr_keys.request_state_security(p, audience=AUD, **kw), "single_use_fro", "single_use_for"),
        (lambda p, **kw: mrtr_keys.request_state_security(p, audience=AUD, **kw), "kms_key_di", "kms_key_id"),
        (lambda p, **kw: mrtr_keys.open_codec(p, audience=AUD, **kw), "heartbeat_evry", "heartbeat_every"),
        (lambda p, **kw: mrtr_keys.open_codec(p, audience=AUD, **kw), "read_timout", "read_timeout"),
        (
            lambda p, **kw: mrtr_keys.request_state_security(sidecar=SIDECAR, audience=AUD, secret="s", **kw),
            "timout",
            "timeout",
        ),
        (
            lambda p, **kw: sidecar_security(SIDECAR, audience=AUD, secret="s", **kw),
            "conect_timeout",
            "connect_timeout",
        ),
        (lambda p, **kw: backend_for("local", **kw), "setings", "settings"),
        (
            lambda p, **kw: create_ring(FileKeystore(p.parent / "new.json"), backend_options=kw),
            "max_attempt",
            "max_attempts",
        ),
    ],
    ids=[
        "request_state_security",
        "request_state_security-own-keyword",
        "request_state_security-backend-keyword",
        "open_codec",
        "open_codec-backend-keyword",
        "request_state_security-sidecar",
        "sidecar_security",
        "backend_for",
        "create_ring",
    ],
)
def test_an_unknown_keyword_is_refused_naming_it_and_the_closest_valid_one(
    keystore_path: Path, call: Any, typo: str, closest: str
) -> None:
    before = _threads()
    with pytest.raises(ConfigError) as info:
        call(keystore_path, **{typo: 3})
    message = str(info.value)
    assert f"unknown keyword {typo}=" in message
    assert message.endswith(f"(the closest it takes is {closest}=)")
    assert _threads() <= before  # refused before anything was opened: no watcher, no audit writer
    assert not (keystore_path.parent / "new.json").exists()


def test_the_sidecar_codec_refuses_a_key_ring_codec_option() -> None:
    """``reload_every`` is an option of a key-ring codec; the sidecar codec reloads nothing, so it is refused."""
    with pytest.raises(
        ConfigError, match=r"request_state_security\(sidecar=\.\.\.\) got an unknown keyword reload_every="
    ):
        mrtr_keys.request_state_security(sidecar=SIDECAR, audience=AUD, secret="s", reload_every=3)


def test_an_option_of_another_backend_is_accepted(keystore_path: Path) -> None:
    """A fleet's settings cover every ring it may meet: a KMS client setting given to an instance whose ring is
    local is no typo, and is not passed to the local backend."""
    security = mrtr_keys.request_state_security(
        keystore_path, audience=AUD, audit=False, read_timeout=2.0, reload_every=0
    )
    assert security.codec.unseal(security.codec.seal(b"x")) == b"x"


def test_the_valid_keywords_still_work(keystore_path: Path) -> None:
    codec = mrtr_keys.open_codec(keystore_path, audience=AUD, reload_every=0, lease=0, instance="i-1")
    assert codec.unseal(codec.seal(b"ok")) == b"ok"
    create_ring(FileKeystore(keystore_path.parent / "other.json"), backend_options={"read_timeout": 1.0})
