"""Fingerprints: keyed (HMAC-SHA256 under audit.key), over the token's decoded bytes, never the token."""

from __future__ import annotations

import hashlib
import hmac
import stat
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from mrtr_keys.audit.fingerprint import AUDIT_KEY_FILE, Fingerprinter, load_audit_key
from mrtr_keys.codecs.local import LocalAESGCMCodec
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
