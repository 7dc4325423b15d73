"""`VaultTransitCodec` against a real OpenBao dev server, both modes.

Rules under test come from the transit API (https://openbao.org/api-docs/secret/transit/):
derived key with context = audience, explicit key_version, standard base64 plaintext, a refused
ciphertext is InvalidRequestState, Vault unreachable is BackendUnavailable, no retry of a refused decrypt.
"""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.backends import backend_for
from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.codecs.vault_transit import (
    TOKEN_PREFIX,
    TransitEncryptError,
    VaultTransitCodec,
    split_vault_ciphertext,
    vault_ciphertext,
)
from mrtr_keys.errors import BackendUnavailable, ConfigError
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.providers.vault.client import VaultClient, VaultSettings
from mrtr_keys.ring.model import CodecSpec
from tests.fixtures.openbao import OpenBao
from tests.support.proxy import CountingProxy

MODES = ["remote", "datakey"]
B64URL_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
PAYLOADS = [b"", b"\xfb\xef\xff", b'{"s":"state"}', bytes(range(256)) * 8]


def make_ring(tmp_path: Path, key: str, mode: str, name: str = "ring.json", audiences: tuple[str, ...] = ()) -> Path:
    path = tmp_path / name
    create_ring(FileKeystore(path), codec=CodecSpec("vault-transit", {"key": key, "mode": mode}), audiences=audiences)
    return path


def b64u(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decoded(token: str, prefix: str) -> bytearray:
    body = token[len(prefix) :]
    return bytearray(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("payload", PAYLOADS, ids=["empty", "fbefff", "json", "2k"])
def test_payloads_round_trip_exactly(
    bao_env: dict[str, str], transit_key: str, tmp_path: Path, mode: str, payload: bytes
) -> None:
    """Bytes fb ef ff (not UTF-8) and an empty payload round-trip exactly in both modes."""
    codec = VaultTransitCodec(make_ring(tmp_path, transit_key, mode), audience="billing")
    token = codec.seal(payload)
    assert token.startswith(TOKEN_PREFIX if mode == "remote" else "mk2.")
    assert codec.unseal(token) == payload


def test_remote_seal_and_unseal_each_make_one_transit_call(
    bao_env: dict[str, str], openbao: OpenBao, transit_key: str, tmp_path: Path
) -> None:
    """Remote mode: keys never leave Vault; every seal is transit/encrypt, every unseal transit/decrypt."""
    codec = VaultTransitCodec(make_ring(tmp_path, transit_key, "remote"), audience="billing")
    token = codec.seal(b"x")
    assert codec.unseal(token) == b"x"
    assert openbao.requests_to(f"transit/encrypt/{transit_key}") == 1
    assert openbao.requests_to(f"transit/decrypt/{transit_key}") == 1


@pytest.mark.parametrize("mode", MODES)
def test_both_modes_count_seals_unseals_and_rejections_against_their_budget(
    bao_env: dict[str, str], transit_key: str, tmp_path: Path, mode: str
) -> None:
    """Issue 36: remote mode (Vault's own format) is counted like the shared core, with Vault's limit (2^32 a
    transit key version, halved) as its budget; datakey mode makes mk2 keys (2^48, halved)."""
    from mrtr_keys.codecs.usage import usage_for
    from mrtr_keys.ring.budgets import budget_of

    codec = VaultTransitCodec(make_ring(tmp_path, transit_key, mode), audience="billing")
    ring = codec.ring
    for _ in range(3):
        codec.unseal(codec.seal(b"x"))
    sealed = codec.seal(b"y")
    with pytest.raises(InvalidRequestState):
        codec.unseal(sealed[:-2] + ("BA" if sealed.endswith("AA") else "AA"))
    tally = usage_for(ring.ring_id).kid(ring.primary.kid)
    assert (tally.seals, tally.unseals, tally.rejections) == (4, 3, 1)
    assert budget_of(ring, ring.primary) == (2**31 if mode == "remote" else 2**47)


def test_datakey_mode_unwraps_once_then_makes_no_vault_call_per_token(
    bao_env: dict[str, str], openbao: OpenBao, transit_key: str, tmp_path: Path
) -> None:
    """Datakey mode: data keys are unwrapped once with transit/decrypt, then tokens are local."""
    codec = VaultTransitCodec(make_ring(tmp_path, transit_key, "datakey"), audience="billing")
    assert openbao.requests_to(f"transit/decrypt/{transit_key}") == 1
    for i in range(20):
        assert codec.unseal(codec.seal(bytes([i]))) == bytes([i])
    assert openbao.requests_to(f"transit/decrypt/{transit_key}") == 1
    assert openbao.requests_to(f"transit/encrypt/{transit_key}") == 0


def test_a_token_for_another_audience_is_rejected_with_exactly_one_vault_call(
    bao_env: dict[str, str], openbao: OpenBao, transit_key: str, tmp_path: Path
) -> None:
    """Sealed for `a`, unsealed for `b`: Vault refuses (context = audience) and the codec does not
    retry a refused decrypt; the OpenBao audit log shows exactly one decrypt request."""
    path = make_ring(tmp_path, transit_key, "remote")
    token = VaultTransitCodec(path, audience="a").seal(b"for a only")
    other = VaultTransitCodec(path, audience="b")
    before = openbao.requests_to(f"transit/decrypt/{transit_key}")
    with pytest.raises(InvalidRequestState, match="vault refused"):
        other.unseal(token)
    assert openbao.requests_to(f"transit/decrypt/{transit_key}") == before + 1
    assert VaultTransitCodec(path, audience="a").unseal(token) == b"for a only"


def test_datakey_tokens_are_bound_to_the_audience_too(
    bao_env: dict[str, str], transit_key: str, tmp_path: Path
) -> None:
    path = make_ring(tmp_path, transit_key, "datakey")
    token = VaultTransitCodec(path, audience="a").seal(b"for a only")
    with pytest.raises(InvalidRequestState):
        VaultTransitCodec(path, audience="b").unseal(token)


def test_remote_token_layout_and_tampering(
    bao_env: dict[str, str], openbao: OpenBao, transit_key: str, tmp_path: Path
) -> None:
    """Our token wraps Vault's ciphertext bytes: kid[4] || key_version[4] || nonce[12] || ct || tag[16].
    A flipped bit anywhere is rejected; a wrong version or kid is rejected before any Vault call."""
    codec = VaultTransitCodec(make_ring(tmp_path, transit_key, "remote"), audience="billing")
    token = codec.seal(b"abc")
    raw = decoded(token, TOKEN_PREFIX)
    assert len(raw) == 4 + 4 + 12 + 3 + 16
    assert raw[:4].hex() == codec.ring.primary.kid
    assert int.from_bytes(raw[4:8], "big") == 1
    calls = openbao.requests_to(f"transit/decrypt/{transit_key}")
    for index, reason in [(0, "unknown kid"), (7, "version")]:
        bad = bytearray(raw)
        bad[index] ^= 1
        with pytest.raises(InvalidRequestState, match=reason):
            codec.unseal(TOKEN_PREFIX + b64u(bytes(bad)))
    assert openbao.requests_to(f"transit/decrypt/{transit_key}") == calls  # refused locally
    for index in (8, 20, len(raw) - 1):
        bad = bytearray(raw)
        bad[index] ^= 0x80
        with pytest.raises(InvalidRequestState, match="vault refused"):
            codec.unseal(TOKEN_PREFIX + b64u(bytes(bad)))
    for spelling in (token + "=", token[:-1], "mk1." + token[len(TOKEN_PREFIX) :], token + "A" * 70000):
        with pytest.raises(InvalidRequestState):
            codec.unseal(spelling)
    assert codec.unseal(token) == b"abc"


def test_a_non_derived_transit_key_is_refused_at_construction(
    bao_env: dict[str, str], openbao: OpenBao, tmp_path: Path
) -> None:
    """A key that is not derived cannot bind tokens to an audience; the message says how to make one."""
    name = openbao.new_transit_key(derived=False)
    with pytest.raises(ConfigError, match=rf"bao write -f transit/keys/{name} derived=true"):
        make_ring(tmp_path, name, "remote")
    # A ring pointing at it (e.g. the key was re-created) is refused when the codec is built.
    good = openbao.new_transit_key()
    path = make_ring(tmp_path, good, "remote")
    ring = FileKeystore(path).load()
    FileKeystore(path).save(
        ring.next_generation(codec=CodecSpec("vault-transit", {"key": name, "mode": "remote"})),
        expected_generation=ring.generation,
    )
    with pytest.raises(ConfigError, match="is not derived") as refused:
        VaultTransitCodec(path, audience="billing")
    assert "create_key" in str(refused.value)


def test_a_missing_transit_key_is_refused_with_how_to_create_it(bao_env: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist at mount 'transit'; create one with: bao write -f"):
        make_ring(tmp_path, "no-such-key", "remote")


def test_a_mode_mismatch_and_a_foreign_ring_are_config_errors(
    bao_env: dict[str, str], transit_key: str, tmp_path: Path, keystore_path: Path
) -> None:
    path = make_ring(tmp_path, transit_key, "remote")
    with pytest.raises(ConfigError, match="mode 'remote', not 'datakey'"):
        VaultTransitCodec(path, audience="billing", mode="datakey")
    with pytest.raises(ConfigError, match="'local' codec"):
        VaultTransitCodec(keystore_path, audience="billing")
    with pytest.raises(ConfigError, match="--mode must be remote or datakey"):
        backend_for(CodecSpec("vault-transit", {"key": transit_key, "mode": "hybrid"}))


@pytest.mark.parametrize("mode", MODES)
def test_vault_stopped_mid_test_is_backend_unavailable_and_the_same_codec_recovers(
    bao_env: dict[str, str], bao_proxy: CountingProxy, transit_key: str, tmp_path: Path, mode: str
) -> None:
    """Vault unreachable is the distinct `BackendUnavailable` (never InvalidRequestState), and the
    codec works again once the server is back, without being rebuilt."""
    path = make_ring(tmp_path, transit_key, mode)
    codec = VaultTransitCodec(path, audience="billing")
    before = codec.seal(b"before the outage")
    bao_proxy.stop()
    if mode == "remote":
        with pytest.raises(BackendUnavailable, match="unreachable"):
            codec.seal(b"x")
        with pytest.raises(BackendUnavailable, match="unreachable"):
            codec.unseal(before)
    else:  # data keys are in memory: tokens keep working; only unwrapping a new key needs Vault
        assert codec.unseal(codec.seal(b"during")) == b"during"
        run_step_during_outage = pytest.raises(BackendUnavailable)
        with run_step_during_outage:
            run_step(FileKeystore(path), "begin")
        with pytest.raises(BackendUnavailable):
            VaultTransitCodec(path, audience="billing")
    bao_proxy.start()
    assert codec.unseal(before) == b"before the outage"
    assert codec.unseal(codec.seal(b"after")) == b"after"


def test_encrypt_answer_without_the_asked_version_and_a_retired_pin_reload_once(
    bao_env: dict[str, str], openbao: OpenBao, transit_key: str, tmp_path: Path
) -> None:
    """A codec whose pinned version Vault refuses to encrypt with reloads the rotation state once
    and retries; if the ring has not moved, it fails with a clear error instead of looping."""
    path = make_ring(tmp_path, transit_key, "remote")
    stale = VaultTransitCodec(path, audience="billing")  # loaded at phase 0: pinned to version 1
    store = FileKeystore(path)
    run_step(store, "begin")
    run_step(store, "promote")
    run_step(store, "retire", force=True)  # min_encryption_version = 2
    token = stale.seal(b"after retire")
    assert int.from_bytes(decoded(token, TOKEN_PREFIX)[4:8], "big") == 2
    assert stale.ring.generation == store.load().generation
    assert stale.unseal(token) == b"after retire"
    # Vault raised further by hand (outside the ring): the reload finds nothing new, so it fails once.
    openbao.api("POST", f"transit/keys/{transit_key}/rotate")
    openbao.api("POST", f"transit/keys/{transit_key}/config", {"min_encryption_version": 3})
    encrypts = openbao.requests_to(f"transit/encrypt/{transit_key}")
    with pytest.raises(TransitEncryptError, match="version 2"):
        stale.seal(b"refused")
    assert openbao.requests_to(f"transit/encrypt/{transit_key}") == encrypts + 1


def test_settings_from_the_vault_and_bao_environments() -> None:
    s = VaultSettings.from_env(
        {
            "VAULT_ADDR": "https://v:8200",
            "VAULT_TOKEN": "t",
            "BAO_ADDR": "http://b:1",
            "VAULT_NAMESPACE": "team",
            "VAULT_CLIENT_TIMEOUT": "3s",
            "VAULT_MAX_RETRIES": "0",
        }
    )
    assert (s.addr, s.namespace, s.timeout, s.max_retries) == ("https://v:8200", "team", 3.0, 0)
    b = VaultSettings.from_env({"BAO_ADDR": "http://127.0.0.1:8200", "BAO_TOKEN": "s.secret-token"})
    assert b.addr == "http://127.0.0.1:8200"
    assert "secret-token" not in repr(b) and "secret-token" not in repr(VaultClient(b))
    with pytest.raises(ConfigError, match="no Vault address"):
        VaultSettings.from_env({"VAULT_TOKEN": "t"})
    with pytest.raises(ConfigError, match="no Vault credentials"):
        VaultSettings.from_env({"VAULT_ADDR": "http://x:1"})
    with pytest.raises(ConfigError, match="VAULT_CLIENT_CERT and VAULT_CLIENT_KEY"):
        VaultSettings.from_env({"VAULT_ADDR": "http://x:1", "VAULT_TOKEN": "t", "VAULT_CLIENT_CERT": "/c.pem"})


def test_approle_login(openbao: OpenBao, transit_key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AppRole auth; the server policy is least privilege (docs/vault.md): it can seal and unseal
    but not rotate."""
    policy = (
        f'path "transit/encrypt/{transit_key}" {{ capabilities = ["update"] }}\n'
        f'path "transit/decrypt/{transit_key}" {{ capabilities = ["update"] }}\n'
        f'path "transit/keys/{transit_key}" {{ capabilities = ["read"] }}\n'
    )
    openbao.api("PUT", f"sys/policies/acl/server-{transit_key}", {"policy": policy})
    try:
        openbao.api("POST", "sys/auth/approle", {"type": "approle"})
    except RuntimeError as exc:
        assert "path is already in use" in str(exc)
    openbao.api("POST", f"auth/approle/role/{transit_key}", {"token_policies": [f"server-{transit_key}"]})
    role_id = openbao.api("GET", f"auth/approle/role/{transit_key}/role-id")["data"]["role_id"]  # type: ignore[index]
    secret_id = openbao.api("POST", f"auth/approle/role/{transit_key}/secret-id")["data"]["secret_id"]  # type: ignore[index]
    for name in ("VAULT_TOKEN", "BAO_TOKEN", "VAULT_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BAO_ADDR", openbao.addr)
    monkeypatch.setenv("VAULT_ROLE_ID", str(role_id))
    monkeypatch.setenv("VAULT_SECRET_ID", str(secret_id))
    path = make_ring(tmp_path, transit_key, "remote")
    codec = VaultTransitCodec(path, audience="billing")
    assert codec.unseal(codec.seal(b"approle")) == b"approle"
    with pytest.raises(ConfigError, match="the deploy role's policy needs update"):
        run_step(FileKeystore(path), "begin")


def test_a_refused_login_is_an_outage_not_an_invalid_token(
    openbao: OpenBao, transit_key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Kubernetes service-account login (VAULT_K8S_ROLE) seals and unseals; once the login is refused
    (here: the token file now holds another service account's JWT, and the 1 s login has run out), an
    unseal is BackendUnavailable (the service is down for this instance), never InvalidRequestState."""
    from tests.fixtures.k8s_login import ServiceAccountIssuer

    policy = (
        f'path "transit/encrypt/{transit_key}" {{ capabilities = ["update"] }}\n'
        f'path "transit/decrypt/{transit_key}" {{ capabilities = ["update"] }}\n'
        f'path "transit/keys/{transit_key}" {{ capabilities = ["read"] }}\n'
    )
    openbao.api("PUT", f"sys/policies/acl/pod-{transit_key}", {"policy": policy})
    issuer, mount = ServiceAccountIssuer(), f"k8s-{transit_key}"
    issuer.configure(openbao, mount)
    policies = [f"pod-{transit_key}"]
    issuer.role(
        openbao, mount, "pod", namespace="mcp", account="mcp-billing", audience="vault", policies=policies, ttl="1s"
    )
    jwt = tmp_path / "token"
    jwt.write_text(issuer.token("mcp", "mcp-billing", audience="vault"))
    for name in ("VAULT_TOKEN", "BAO_TOKEN", "VAULT_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BAO_ADDR", openbao.addr)
    monkeypatch.setenv("VAULT_K8S_ROLE", "pod")
    monkeypatch.setenv("VAULT_K8S_MOUNT", mount)
    monkeypatch.setenv("VAULT_K8S_TOKEN_FILE", str(jwt))
    codec = VaultTransitCodec(make_ring(tmp_path, transit_key, "remote"), audience="billing")
    token = codec.seal(b"k8s")
    assert codec.unseal(token) == b"k8s"
    jwt.write_text(issuer.token("mcp", "someone-else", audience="vault"))
    time.sleep(1.1)  # the 1 s login lease ran out: the next call logs in again, and is refused
    with pytest.raises(
        BackendUnavailable, match=f"Vault refused the Kubernetes login \\(role 'pod', POST auth/{mount}/login\\)"
    ):
        codec.unseal(token)


def test_tls_with_a_ca_bundle(openbao_tls: OpenBao, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TLS options. With VAULT_CACERT naming the server's CA the codec works; without it the
    certificate is not trusted and the failure is BackendUnavailable naming the TLS error."""
    assert openbao_tls.ca_cert is not None
    key = openbao_tls.new_transit_key()
    for name in ("VAULT_ADDR", "VAULT_TOKEN", "BAO_ADDR", "BAO_TOKEN", "VAULT_CACERT", "BAO_CACERT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VAULT_ADDR", openbao_tls.addr)
    monkeypatch.setenv("VAULT_TOKEN", openbao_tls.token)
    monkeypatch.setenv("VAULT_CACERT", str(openbao_tls.ca_cert))
    monkeypatch.setenv("VAULT_MAX_RETRIES", "0")
    path = make_ring(tmp_path, key, "remote")
    codec = VaultTransitCodec(path, audience="billing")
    assert codec.unseal(codec.seal(b"\xfb\xef\xff")) == b"\xfb\xef\xff"
    monkeypatch.delenv("VAULT_CACERT")
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    with pytest.raises(BackendUnavailable, match="SSLError"):
        VaultTransitCodec(path, audience="billing")


@given(version=st.integers(1, 2**32 - 1), raw=st.binary(max_size=64))
def test_vault_ciphertext_text_round_trips(version: int, raw: bytes) -> None:
    assert split_vault_ciphertext(vault_ciphertext(version, raw)) == (version, raw)


@given(text=st.text(max_size=80) | st.from_regex(r"vault:v[0-9]{1,3}:[A-Za-z0-9+/=]{0,24}", fullmatch=True))
def test_vault_ciphertext_parser_accepts_only_the_canonical_spelling(text: str) -> None:
    """Vault's answer is parsed strictly: whatever parses re-renders to exactly the same text."""
    try:
        version, raw = split_vault_ciphertext(text)
    except ValueError:
        return
    assert vault_ciphertext(version, raw) == text


def test_random_text_never_escapes_unseal_as_anything_but_invalid_request_state(
    bao_env: dict[str, str], openbao: OpenBao, transit_key: str, tmp_path: Path
) -> None:
    """SDK contract on untrusted input: arbitrary text (and near-tokens with our prefix) is refused with
    InvalidRequestState, and none of it reaches Vault (no kid of the ring matches)."""
    codec = VaultTransitCodec(make_ring(tmp_path, transit_key, "remote"), audience="billing")
    calls = openbao.requests_to(f"transit/decrypt/{transit_key}")

    @settings(max_examples=300, deadline=None)
    @given(text=st.text(max_size=120) | st.text(alphabet=B64URL_ALPHABET, max_size=120).map(TOKEN_PREFIX.__add__))
    def check(text: str) -> None:
        with pytest.raises(InvalidRequestState):
            codec.unseal(text)

    check()
    assert openbao.requests_to(f"transit/decrypt/{transit_key}") == calls
