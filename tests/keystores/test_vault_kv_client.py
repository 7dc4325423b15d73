"""The vault-kv keystore shares the transit codec's Vault client: a namespace and a TLS server
verified with a CA bundle work as for transit, from the same settings."""

from __future__ import annotations

import secrets
import time

import pytest

from mrtr_keys.changes.create import create_ring
from mrtr_keys.changes.rotation import run_step
from mrtr_keys.errors import KeystoreUnavailable
from mrtr_keys.keystores.vault_kv import VaultKVKeystore
from mrtr_keys.providers.vault.client import VaultClient, VaultSettings
from tests.fixtures.openbao import OpenBao


def test_a_ring_in_a_namespace(openbao: OpenBao) -> None:
    namespace = f"team-{secrets.token_hex(3)}"
    openbao.api("POST", f"sys/namespaces/{namespace}", {})
    openbao.api("POST", f"{namespace}/sys/mounts/kv", {"type": "kv", "options": {"version": "2"}})
    settings = VaultSettings(addr=openbao.addr, token=openbao.token, namespace=namespace)
    store = VaultKVKeystore("kv", "mrtr/keyring", client=VaultClient(settings))
    deadline = time.monotonic() + 30
    while True:  # a mount just enabled as kv-v2 upgrades itself for a moment: a retry-later, not a refusal
        try:
            ring = create_ring(store).ring
            break
        except KeystoreUnavailable as exc:
            assert "upgrading the KV mount 'kv'" in str(exc) and time.monotonic() < deadline, str(exc)
            time.sleep(0.1)
    assert store.load() == ring and store.revision() == "1"
    stored = openbao.api("GET", f"{namespace}/kv/data/mrtr/keyring")["data"]
    assert stored["metadata"]["version"] == 1  # type: ignore[index]


@pytest.mark.e2e  # a second OpenBao server
def test_a_ring_over_tls_verified_with_the_ca_bundle(openbao_tls: OpenBao) -> None:
    settings = VaultSettings(addr=openbao_tls.addr, token=openbao_tls.token, ca_cert=str(openbao_tls.ca_cert))
    store = VaultKVKeystore("secret", "mrtr/tls", client=VaultClient(settings))
    create_ring(store)
    assert run_step(store, "begin").ring.generation == 2
    assert store.revision() == "2" and store.load().generation == 2


def test_a_revoked_login_token_is_replaced_by_a_new_login(openbao: OpenBao, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token the client logged in for (AppRole here; the Kubernetes login takes the same path) that Vault
    no longer honours (revoked, or lost with a restarted dev server) answers 403: the client logs in again
    and the read succeeds, instead of failing until 80 % of the token's TTL has passed."""
    from mrtr_keys.providers.vault import login as vault_login

    name = f"relogin-{secrets.token_hex(3)}"
    policy = f'path "secret/data/{name}" {{ capabilities = ["read", "create", "update"] }}'
    openbao.api("PUT", f"sys/policies/acl/{name}", {"policy": policy})
    try:
        openbao.api("POST", "sys/auth/approle", {"type": "approle"})
    except RuntimeError as exc:
        assert "path is already in use" in str(exc)
    openbao.api("POST", f"auth/approle/role/{name}", {"token_policies": [name], "token_ttl": "1h"})
    role_id = openbao.api("GET", f"auth/approle/role/{name}/role-id")["data"]["role_id"]  # type: ignore[index]
    secret_id = openbao.api("POST", f"auth/approle/role/{name}/secret-id")["data"]["secret_id"]  # type: ignore[index]
    client = VaultClient(VaultSettings(addr=openbao.addr, role_id=str(role_id), secret_id=str(secret_id)))
    store = VaultKVKeystore("secret", name, client=client)
    ring = create_ring(store).ring
    monkeypatch.setattr(vault_login, "RELOGIN_AFTER_403", 0.0)
    openbao.api("POST", "auth/token/revoke", {"token": client._hvac.token})
    assert store.load() == ring
