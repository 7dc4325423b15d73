"""`ReplayGuard` / `SingleUseCodec` over the real local codec and the real stores: what is consumed, what is
refused with which reason, what is left alone, and what happens while the store is away (docs/single-use.md)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys import replay
from mrtr_keys.codecs.local import LocalAESGCMCodec
from mrtr_keys.errors import ConfigError, ReplayStoreUnavailable
from mrtr_keys.factory import request_state_security
from mrtr_keys.replay import ReplayGuard, SingleUseCodec, Targets
from mrtr_keys.replay.guard import token_bytes
from tests.fixtures.codec_contract import tampered
from tests.support.proxy import CountingProxy


def envelope(target: str = "approve_payment", *, method: str = "tools/call", exp_in: float = 600.0) -> bytes:
    """A claims envelope shaped like the one `RequestStateBoundary._seal` builds."""
    now = time.time()
    claims = {"v": 1, "iat": now, "exp": now + exp_in, "m": method, "t": target, "a": "x", "s": "state"}
    return json.dumps(claims, separators=(",", ":")).encode()


def single_use(keystore_path: Path, url: str, **kw: Any) -> SingleUseCodec:
    inner = LocalAESGCMCodec(keystore_path, audience="svc")
    return SingleUseCodec(inner, ReplayGuard(replay.open_store(url), fallback_ttl=600.0, **kw))


def reason(fn: Any, *args: Any) -> str:
    with pytest.raises(InvalidRequestState) as info:
        fn(*args)
    return str(info.value)


def test_a_token_unseals_once_then_is_replayed_on_every_instance(keystore_path: Path, replay_url: str) -> None:
    a, b = single_use(keystore_path, replay_url), single_use(keystore_path, replay_url)
    token = a.seal(envelope())
    assert json.loads(a.unseal(token))["s"] == "state"
    assert reason(a.unseal, token) == "replayed"
    assert reason(b.unseal, token) == "replayed"
    assert reason(a.unseal, tampered(token)) == "seal"  # the inner codec's reasons come first


def test_an_expired_token_is_refused_and_not_recorded(keystore_path: Path, redis_replay_url: str) -> None:
    codec = single_use(keystore_path, redis_replay_url)
    token = codec.seal(envelope(exp_in=-1.0))
    assert reason(codec.unseal, token) == "expired"
    assert codec.guard.store.consume(codec.guard.token_id(token), 1000) is True  # it was never consumed


def test_only_the_named_targets_are_single_use(keystore_path: Path, redis_replay_url: str) -> None:
    codec = single_use(keystore_path, redis_replay_url, only={"approve_payment", "invoice://{id}/pay"})
    other = codec.seal(envelope("list_payments"))
    assert codec.unseal(other) == codec.unseal(other)  # today's behaviour: until it expires
    named = codec.seal(envelope("approve_payment"))
    codec.unseal(named)
    assert reason(codec.unseal, named) == "replayed"
    templated = codec.seal(envelope("invoice://42/pay", method="resources/read"))
    codec.unseal(templated)
    assert reason(codec.unseal, templated) == "replayed"
    free = codec.seal(envelope("invoice://42/view", method="resources/read"))
    codec.unseal(free)
    codec.unseal(free)


def test_a_payload_that_is_not_an_envelope_is_guarded_for_the_ttl(keystore_path: Path, redis_replay_url: str) -> None:
    import redis

    codec = single_use(keystore_path, redis_replay_url, only={"approve_payment"})
    token = codec.seal(b"not json")
    assert codec.unseal(token) == b"not json"
    assert reason(codec.unseal, token) == "replayed"
    prefix = redis_replay_url.split("prefix=")[1]
    client = redis.Redis.from_url(redis_replay_url.split("?")[0])
    ttl = client.pttl(prefix + codec.guard.token_id(token).hex())
    # the TTL bound plus the SDK's 60 s future skew, rounded up by a millisecond (a record never lives less), read
    # back within the same millisecond at most
    assert 600_000 < ttl <= 660_001


def test_the_store_never_holds_the_token(keystore_path: Path, redis_replay_url: str) -> None:
    import redis

    codec = single_use(keystore_path, redis_replay_url)
    token = codec.seal(envelope())
    codec.unseal(token)
    client = redis.Redis.from_url(redis_replay_url.split("?")[0])
    prefix = redis_replay_url.split("prefix=")[1]
    stored = b"".join(k + (client.get(k) or b"") for k in client.scan_iter(match=prefix + "*"))
    raw = token_bytes(token)
    for secret in (token.encode(), raw, raw[8:24], raw[-16:]):
        assert secret not in stored


def test_store_errors_fail_closed_unless_allowed(
    keystore_path: Path, store_proxy: tuple[str, CountingProxy], caplog: pytest.LogCaptureFixture
) -> None:
    from prometheus_client import REGISTRY

    def counted(outcome: str) -> float:
        return REGISTRY.get_sample_value("mrtr_keys_single_use_total", {"outcome": outcome}) or 0.0

    url, proxy = store_proxy
    deny, allow = single_use(keystore_path, url), single_use(keystore_path, url, on_store_error="allow")
    warm = deny.seal(envelope())
    deny.unseal(warm)  # the fleet key is read while the store is up
    allow.unseal(allow.seal(envelope()))
    proxy.stop()
    token = deny.seal(envelope())
    denied, allowed = counted("store_error_denied"), counted("store_error_allowed")
    assert reason(deny.unseal, token) == "replay store unavailable"
    assert counted("store_error_denied") == denied + 1
    with pytest.raises(ReplayStoreUnavailable):
        deny.guard.check(token, envelope())
    assert deny.ready() is False
    assert json.loads(allow.unseal(token))["s"] == "state"  # served, unrecorded
    assert counted("store_error_allowed") == allowed + 1
    proxy.start()
    assert json.loads(deny.unseal(token))["s"] == "state"  # the same token, once the store is back
    assert reason(deny.unseal, token) == "replayed"
    assert deny.ready() is True


def test_targets_and_options_are_checked(keystore_path: Path) -> None:
    for bad in ("approve_payment", [], [""], [1]):
        with pytest.raises(ConfigError):
            Targets(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        request_state_security(keystore_path, audience="svc", audit=False, single_use_for={"approve_payment"})
    with pytest.raises(ConfigError):
        request_state_security(keystore_path, audience="svc", audit=False, single_use="ftp://x", on_store_error="deny")
    with pytest.raises(ConfigError):
        ReplayGuard(replay.open_store("redis://127.0.0.1:6379/13"), fallback_ttl=60, on_store_error="maybe")  # type: ignore[arg-type]


def test_token_bytes_is_prefix_and_decoded_body() -> None:
    raw = os.urandom(40)
    import base64

    token = "mk1." + base64.urlsafe_b64encode(raw).decode().rstrip("=")
    assert token_bytes(token) == b"mk1." + raw
    assert token_bytes("no-dot-here") == b"no-dot-here"
