"""URLs users hand the library: a password in one never shows in a repr() or a message; a NUL is refused."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import mrtr_keys
from mrtr_keys.codecs.sidecar_client import SidecarCodec
from mrtr_keys.errors import BackendUnavailable, ConfigError
from mrtr_keys.urls import redact
from tests.support.net import refused_port


def test_a_sidecar_url_with_a_password_never_shows_it() -> None:
    with refused_port() as port:
        codec = SidecarCodec(f"http://ops:S3cretPW@127.0.0.1:{port}", audience="billing", secret="mks_x")
        assert repr(codec) == f"SidecarCodec('http://ops:***@127.0.0.1:{port}', audience='billing')"
        with pytest.raises(BackendUnavailable) as down:
            codec.seal(b"x")
        codec.close()
    assert str(down.value) == f"sidecar http://ops:***@127.0.0.1:{port} unreachable: ConnectError"
    with pytest.raises(ConfigError) as bad:
        SidecarCodec("ftp://ops:S3cretPW@host", audience="billing", secret="mks_x")
    assert "S3cretPW" not in str(bad.value) and "ftp://ops:***@host" in str(bad.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keystore": "ring\x00.json"}, "a keystore location cannot contain a NUL byte"),
        ({"keystore": "file:///tmp/ring%00.json"}, "a keystore location cannot contain a NUL byte"),
        ({"audit": "sqlite:///tmp/a%00b.db"}, "an audit store URL cannot contain a NUL byte"),
    ],
)
def test_a_nul_byte_in_a_location_is_a_config_error(keystore_path: Path, kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        mrtr_keys.request_state_security(**{"keystore": str(keystore_path), **kwargs}, audience="billing")
    assert str(refused.value) == message


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://app:pw@db:5432/x", "postgresql://app:***@db:5432/x"),
        ("redis://:pw@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("http://u:pw@[::1/x", "http://[::1/x"),  # unparsable: the userinfo is dropped whole
        ("postgresql://app@db/x?sslmode=require&password=pw", "postgresql://app@db/x?sslmode=require&password=***"),
        ("postgresql://app:a@db/x?PASSWD=b", "postgresql://app:***@db/x?PASSWD=***"),
        ("sqlite:///tmp/audit.db", "sqlite:///tmp/audit.db"),
    ],
)
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_a_sidecar_not_up_at_start_is_logged_without_the_url_password(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with refused_port() as port:
        security = mrtr_keys.request_state_security(
            sidecar=f"http://ops:S3cretPW@127.0.0.1:{port}", audience="billing", secret="mks_x"
        )
    security.codec.close()  # type: ignore[attr-defined]
    assert f"sidecar http://ops:***@127.0.0.1:{port} not checked at start" in caplog.text
    assert "S3cretPW" not in caplog.text
