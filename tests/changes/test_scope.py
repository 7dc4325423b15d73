"""A key ring's audience scope: the audiences it may seal and unseal for; empty means any.
Names are exact and case-sensitive; a codec for an audience outside the scope fails at
construction (fail at construction, not on first use, as Tink does)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp.server.mcpserver import InvalidRequestState

import mrtr_keys
from mrtr_keys.changes import scope as audience
from mrtr_keys.changes.create import create_ring
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.errors import AudienceError, ConfigError
from mrtr_keys.keystores.file import FileKeystore
from tests.fixtures.keyrings import fresh_ring


@pytest.fixture
def billing(tmp_path: Path) -> FileKeystore:
    store = FileKeystore(tmp_path / "ring.json")
    create_ring(store, audiences=["billing"])
    return store


@pytest.mark.parametrize("name", ["payments", "Billing", "billing-admin", "billing ", "bill", "BILLING"])
def test_a_codec_outside_the_scope_is_refused_at_construction(billing: FileKeystore, name: str) -> None:
    with pytest.raises(AudienceError) as info:
        LocalAESGCMCodec(billing, audience=name)
    message = str(info.value)
    assert repr(name) in message and "(billing)" in message
    assert f"mrtr-keys audience add {name}" in message
    assert "\n" not in message


def test_the_library_entry_point_refuses_it_too(billing: FileKeystore) -> None:
    with pytest.raises(AudienceError):
        mrtr_keys.request_state_security(billing.path, audience="payments")
    security = mrtr_keys.request_state_security(billing.path, audience="billing")
    assert security.audience == "billing"


def test_add_then_remove_grants_then_takes_away(billing: FileKeystore) -> None:
    result = audience.add(billing, "payments")
    assert result.changed and result.ring.audiences == ("billing", "payments")
    codec = LocalAESGCMCodec(billing, audience="payments")
    assert codec.unseal(codec.seal(b"ok")) == b"ok"
    still_billing_only = ("Payments", "payments-admin")
    for name in still_billing_only:
        with pytest.raises(AudienceError):
            LocalAESGCMCodec(billing, audience=name)
    removed = audience.remove(billing, "payments")
    assert removed.changed and removed.ring.audiences == ("billing",)
    with pytest.raises(AudienceError):
        LocalAESGCMCodec(billing, audience="payments")


def test_a_running_codec_keeps_its_ring_when_its_audience_is_removed(billing: FileKeystore) -> None:
    """`reload()` of an unusable stored ring raises and leaves the loaded ring in place."""
    audience.add(billing, "payments")
    codec = LocalAESGCMCodec(billing, audience="payments")
    token = codec.seal(b"before")
    audience.remove(billing, "payments")
    with pytest.raises(AudienceError):
        codec.reload()
    assert codec.unseal(token) == b"before"


def test_add_and_remove_are_idempotent(billing: FileKeystore) -> None:
    assert not audience.add(billing, "billing").changed
    assert not audience.remove(billing, "payments").changed
    assert billing.load().generation == 1


def test_removing_the_last_audience_is_refused_unless_allow_any(billing: FileKeystore) -> None:
    """Our decision: an empty scope allows ANY audience, so a revocation must not open it by accident."""
    with pytest.raises(ConfigError, match="--allow-any"):
        audience.remove(billing, "billing")
    assert billing.load().audiences == ("billing",)
    with pytest.raises(AudienceError):
        LocalAESGCMCodec(billing, audience="anything")
    result = audience.remove(billing, "billing", allow_any=True)
    assert result.ring.audiences == () and "allows any audience" in result.message
    LocalAESGCMCodec(billing, audience="anything")


@pytest.mark.parametrize("name", ["", " billing", "billing\n", "a" * 257, "tab\there"])
def test_unusable_names_are_refused(billing: FileKeystore, name: str) -> None:
    with pytest.raises(ConfigError):
        audience.add(billing, name)
    assert billing.load().audiences == ("billing",)


@pytest.mark.parametrize("scope", [(), ("a", "b")])
def test_a_token_sealed_for_a_never_unseals_for_b_under_the_same_ring(scope: tuple[str, ...]) -> None:
    """The AES key is derived per audience (HKDF info) and the audience is associated data."""
    ring = fresh_ring(audiences=scope)
    a, b = LocalAESGCMCodec.from_ring(ring, audience="a"), LocalAESGCMCodec.from_ring(ring, audience="b")
    token = a.seal(b"for a")
    with pytest.raises(InvalidRequestState):
        b.unseal(token)
    assert a.unseal(token) == b"for a"
    with pytest.raises(InvalidRequestState):
        a.unseal(b.seal(b"for b"))
