"""Fingerprints: keyed (HMAC-SHA256 under audit.key), over the token's decoded bytes, never the token."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mrtr_keys.audit.writing.fingerprint import AUDIT_KEY_FILE, ENV_AUDIT_KEY_FILE, Fingerprinter, load_audit_key
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.errors import ConfigError
from mrtr_keys.token import decoded_bytes


def test_fingerprint_is_hmac_of_decoded_bytes_not_of_the_text(keystore_path: Path) -> None:
    # Two spellings of one token can never get two fingerprints.
    key = load_audit_key(keystore_path.parent)
    token = LocalAESGCMCodec(keystore_path, audience="svc").seal(b"payload")
    decoded = decoded_bytes(token)
    assert decoded is not None
    want = hmac.new(key, decoded, hashlib.sha256).digest()[:12].hex()
    fp = Fingerprinter(key)
    assert fp.fingerprint(token) == want
    assert fp.fingerprint_canonical(token) == want
    assert want != hmac.new(key, token.encode(), hashlib.sha256).digest()[:12].hex()


def test_fingerprint_known_answers() -> None:
    """Fixed vectors computed outside Python (``openssl dgst -sha256 -mac HMAC -macopt hexkey:00..1f``),
    so the stored fingerprints stay what RFC 2104 HMAC-SHA256 gives, whatever computes them."""
    fp = Fingerprinter(bytes(range(32)))
    assert fp.of_bytes(b"mk1.known answer") == "7d041c54e6bf9157c050b208"
    assert fp.fingerprint("not a token") == "97a165563978d583ca4f75fb"  # not PREFIX.BODY: "raw:" + the text


def test_audit_key_is_created_once_mode_0600(tmp_path: Path) -> None:
    k1 = load_audit_key(tmp_path)
    assert stat.S_IMODE((tmp_path / AUDIT_KEY_FILE).stat().st_mode) == 0o600
    assert load_audit_key(tmp_path) == k1
    assert "audit key" in repr(Fingerprinter(k1)) and k1.hex() not in repr(Fingerprinter(k1))


def _secret_file(tmp_path: Path, data: bytes, mode: int, uid: int) -> Path:
    """A key laid out as a Kubernetes Secret volume does: ``audit.key`` a link into ``..data``."""
    (tmp_path / "..data").mkdir(parents=True)
    target = tmp_path / "..data" / "audit.key"
    target.write_bytes(data)
    os.chown(target, uid, 10001)
    target.chmod(mode)
    (tmp_path / "audit.key").symlink_to("..data/audit.key")
    return tmp_path / "audit.key"


def test_a_shared_key_file_from_a_secret_is_used_instead_of_the_state_directory_s_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MRTR_KEYS_AUDIT_KEY_FILE: every process of a fleet reads one key (root:fsGroup 0440, as the kubelet
    writes a Secret with fsGroup); nothing is created in the state directory."""
    key = os.urandom(32)
    shared = _secret_file(tmp_path / "secret", key, 0o440, 0)
    monkeypatch.setenv(ENV_AUDIT_KEY_FILE, str(shared))
    state = tmp_path / "state"
    assert load_audit_key(state) == key and load_audit_key(tmp_path / "other") == key
    assert not (state / AUDIT_KEY_FILE).exists()


@pytest.mark.parametrize(
    ("mode", "uid", "data", "why"),
    [
        (0o440, 10001, None, "by its group and not owned by root"),  # group read is for a root-owned Secret only
        (0o444, 0, None, "accessible by others"),
        (0o460, 0, None, "accessible by others"),  # group write
        (0o440, 0, b"short", "must hold exactly 32 bytes"),
    ],
)
def test_a_shared_key_file_with_wider_permissions_or_the_wrong_size_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int, uid: int, data: bytes | None, why: str
) -> None:
    key = os.urandom(32) if data is None else data
    monkeypatch.setenv(ENV_AUDIT_KEY_FILE, str(_secret_file(tmp_path, key, mode, uid)))
    with pytest.raises(ConfigError, match=why) as caught:
        load_audit_key(tmp_path / "state")
    assert key.hex() not in str(caught.value) and "\n" not in str(caught.value)


def test_a_missing_shared_key_file_is_refused_not_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_AUDIT_KEY_FILE, str(tmp_path / "absent.key"))
    with pytest.raises(ConfigError, match=f"cannot read the audit key .*absent.key \\({ENV_AUDIT_KEY_FILE}\\)"):
        load_audit_key(tmp_path)
    assert not (tmp_path / "absent.key").exists() and not (tmp_path / AUDIT_KEY_FILE).exists()


@given(st.text(max_size=200))
def test_any_text_gets_a_stable_24_hex_fingerprint(text: str) -> None:
    fp = Fingerprinter(b"k" * 32)
    a = fp.fingerprint(text)
    assert a == fp.fingerprint(text) and len(a) == 24 and int(a, 16) >= 0


@given(st.binary(min_size=1, max_size=300))
def test_fast_path_equals_strict_path_for_canonical_tokens(body: bytes) -> None:
    import base64

    token = "mk1." + base64.urlsafe_b64encode(body).rstrip(b"=").decode()
    fp = Fingerprinter(b"k" * 32)
    assert fp.fingerprint_canonical(token) == fp.fingerprint(token)
