"""The ``mk2`` token format (AES-256-GCM-SIV, issue 36): a ring written before it keeps opening its ``mk1.``
tokens through a rotation to an ``mk2`` key until the old key is retired, and no mutation of an ``mk2.`` token
is ever accepted (every failure is the SDK's `InvalidRequestState`, our codec contract)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import KeyFormat, KeyState
from tests.fixtures.keyrings import fresh_ring, write_ring_doc

AUD = "billing"
B64URL = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
OLD_RING = {
    "format": "mrtr-keys.keyring",
    "version": 1,
    "ring_id": "r-0123456789abcdef",
    "generation": 1,
    "ttl_seconds": 600.0,
    "audiences": [],
    "codec": {"type": "local"},
    "created_at": "2026-11-01T12:00:00Z",
    "keys": [
        {
            "kid": "0a0b0c0d",
            "state": "primary",
            "created_at": "2026-11-01T12:00:00Z",
            "promoted_at": "2026-11-01T12:00:00Z",
            "demoted_at": None,
            "retired_at": None,
            "material": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=",
        }
    ],
}
"""A ring exactly as releases before 0.2.0 wrote it: no ``format`` field (so mk1), no budgets."""
MK1_VECTOR = "mk1.CgsMDQABAgMEBQYHCAkKCznrA19r5lkhee3gAwE1yZOwWO5a0g"  # docs/token-format.md


def _reason(codec: LocalAESGCMCodec, token: str) -> str:
    with pytest.raises(InvalidRequestState) as info:
        codec.unseal(token)
    return str(info.value)


def test_a_ring_from_before_mk2_keeps_opening_its_tokens_through_a_rotation_to_mk2_until_retire(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keyring.json"
    write_ring_doc(path, OLD_RING)
    store = FileKeystore(path)
    codec = LocalAESGCMCodec(store, audience=AUD)
    assert store.load().primary.format is KeyFormat.MK1
    old = codec.seal(b"sealed before the upgrade")
    assert old.startswith("mk1.") and codec.unseal(MK1_VECTOR) == b"hello"

    begun = run_step(store, "begin")  # the next begin makes an mk2 key
    assert [k.format for k in begun.ring.keys] == [KeyFormat.MK1, KeyFormat.MK2]
    entry = json.loads(path.read_text())["keys"]
    assert "format" not in entry[0] and entry[1]["format"] == "mk2"  # the old key's entry is written as before
    assert codec.reload()
    assert codec.seal(b"phase 1").startswith("mk1.")  # mk1 still seals until the promote
    promoted = run_step(store, "promote")
    assert codec.reload()
    new = codec.seal(b"after the promote")
    assert new.startswith("mk2.") and codec.unseal(new) == b"after the promote"
    assert codec.unseal(old) == b"sealed before the upgrade" and codec.unseal(MK1_VECTOR) == b"hello"

    promote_at = promoted.ring.primary.promoted_at
    assert promote_at is not None
    run_step(store, "retire", now=promote_at + timedelta(seconds=661))
    assert codec.reload()
    assert _reason(codec, old) == "retired kid" and _reason(codec, MK1_VECTOR) == "retired kid"
    assert codec.unseal(new) == b"after the promote"
    assert [(k.format, k.state) for k in store.load().keys] == [
        (KeyFormat.MK1, KeyState.RETIRED),
        (KeyFormat.MK2, KeyState.PRIMARY),
    ]


RING = fresh_ring()
CODEC = LocalAESGCMCodec.from_ring(RING, audience=AUD)
TOKEN = CODEC.seal(b'{"v":1,"s":"step-2"}')


@st.composite
def mutations(draw: st.DrawFn) -> str:
    """`TOKEN` with 1-4 edits: a character replaced, inserted or deleted, or the prefix changed."""
    text = TOKEN
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["replace", "insert", "delete", "prefix"]))
        i = draw(st.integers(0, max(0, len(text) - 1)))
        char = draw(st.sampled_from(B64URL + ".=+/ \n\x00é") | st.characters())
        if kind == "replace" and text:
            text = text[:i] + char + text[i + 1 :]
        elif kind == "insert":
            text = text[:i] + char + text[i:]
        elif kind == "delete" and text:
            text = text[:i] + text[i + 1 :]
        else:
            text = draw(st.sampled_from(["mk1.", "mk3.", "v1.", "", "MK2.", "mk2"])) + text[4:]
    return text


@settings(max_examples=300)
@given(mutations())
def test_every_mutation_of_an_mk2_token_is_refused(token: str) -> None:
    if token == TOKEN:
        return
    with pytest.raises(InvalidRequestState):
        CODEC.unseal(token)
