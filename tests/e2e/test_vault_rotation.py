"""Rotation on a Vault / OpenBao transit key through `mrtr-keys rotate`, both modes.

The phases are the MCP SDK's (begin: new verifies, old seals; promote: new seals, old verifies;
retire after TTL + 60 s); on a transit key they map to: begin rotates the transit key with sealing
pinned to the old version, promote changes only the ring (min_encryption_version stays), retire
raises min_encryption_version and min_decryption_version. Deploy steps run as the CLI, as a
pipeline would; "instances" are codecs loaded at a given phase and not reloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mcp.server.mcpserver import InvalidRequestState

from mrtr_keys.changes.create import create_ring
from mrtr_keys.codecs.vault_transit import VaultTransitCodec
from mrtr_keys.inspection import inspect_token
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import CodecSpec
from tests.fixtures.common import run_cli
from tests.fixtures.openbao import OpenBao


def inspect_cli(token: str, path: Path, env: dict[str, str]) -> tuple[int, str]:
    """`mrtr-keys inspect TOKEN --json`: the transit key_version and the kid's state, as a user sees them."""
    r = run_cli("inspect", token, "--json", keystore=path, env=env)
    assert r.code == 0, r.err
    info = r.json()
    return info["key_version"], info["state"]


def inspect_version(token: str, path: Path) -> tuple[int, str]:
    """The same answer from the library function the CLI calls (one subprocess less per check)."""
    info = inspect_token(FileKeystore(path), token)
    return info["key_version"], info["state"]


def cli_ok(*args: str, path: Path, env: dict[str, str]) -> dict[str, object]:
    r = run_cli(*args, "--json", keystore=path, env=env)
    assert r.code == 0, r.err
    result: dict[str, object] = r.json()
    return result


@pytest.mark.parametrize("mode", ["remote", "datakey"])
def test_rotation_matrix_through_the_phases(
    bao_env: dict[str, str], openbao: OpenBao, transit_key: str, tmp_path: Path, mode: str
) -> None:
    path = tmp_path / "ring.json"
    env = bao_env
    init = run_cli(
        "init", "--codec", "vault-transit", "--transit-key", transit_key, "--mode", mode, "--json",
        keystore=path, env=env,
    )  # fmt: skip
    assert init.code == 0, init.err
    assert init.json()["codec"] == "vault-transit"
    phase0 = VaultTransitCodec(path, audience="billing")
    t0 = phase0.seal(b"phase 0")
    assert inspect_version(t0, path) == (1, "primary")

    # Phase 1: transit key rotated to v2, sealing stays pinned to v1.
    cli_ok("rotate", "begin", path=path, env=env)
    info = openbao.key_info(transit_key)
    assert info["latest_version"] == 2 and info["min_decryption_version"] == 1
    phase1 = VaultTransitCodec(path, audience="billing")
    t1 = phase1.seal(b"phase 1")
    assert inspect_cli(t1, path, env) == (1, "primary")  # a token sealed in phase 1 carries the old version
    for codec in (phase0, phase1):
        assert codec.unseal(t0) == b"phase 0"
        assert codec.unseal(t1) == b"phase 1"

    # Phase 2: the ring moves sealing to v2; Vault's min_encryption_version is NOT raised.
    cli_ok("rotate", "promote", path=path, env=env)
    assert openbao.key_info(transit_key)["min_encryption_version"] == 0
    phase2 = VaultTransitCodec(path, audience="billing")
    t2 = phase2.seal(b"phase 2")
    assert inspect_version(t2, path) == (2, "primary")
    assert inspect_version(t1, path) == (1, "verify")
    # An instance still at phase 1 keeps sealing (with v1, which Vault still accepts) and unsealing.
    t1_late = phase1.seal(b"late phase 1")
    assert inspect_version(t1_late, path) == (1, "verify")
    for codec in (phase1, phase2):
        assert codec.unseal(t1_late) == b"late phase 1"
        assert codec.unseal(t2) == b"phase 2"
        assert codec.unseal(t0) == b"phase 0"

    # Phase 3: too early without --force (exit 75); `rotate next --force` runs the retire.
    early = run_cli("rotate", "retire", keystore=path, env=env)
    assert early.code == 75 and "would reject tokens still in flight" in early.err
    assert cli_ok("rotate", "next", "--force", path=path, env=env)["step"] == "retire"
    info = openbao.key_info(transit_key)
    assert (info["min_encryption_version"], info["min_decryption_version"]) == (2, 2)
    assert inspect_cli(t1, path, env) == (1, "retired")
    phase3 = VaultTransitCodec(path, audience="billing")
    decrypts = openbao.requests_to(f"transit/decrypt/{transit_key}")
    for token in (t0, t1, t1_late):
        with pytest.raises(InvalidRequestState, match="retired kid"):
            phase3.unseal(token)
    assert openbao.requests_to(f"transit/decrypt/{transit_key}") == decrypts  # refused without asking Vault
    assert phase3.unseal(t2) == b"phase 2"
    if mode == "remote":
        # An instance that has not reloaded still knows v1, but Vault now refuses it.
        with pytest.raises(InvalidRequestState, match="vault refused"):
            phase2.unseal(t1)
    phase2.reload()
    with pytest.raises(InvalidRequestState, match="retired kid"):
        phase2.unseal(t1)
    # An instance left at phase 1 past the retire (a deploy that skipped it):
    t_stale = phase1.seal(b"stale instance")
    if mode == "remote":
        # Vault refuses its pinned v1; it reloads the ring once and seals with v2.
        assert inspect_version(t_stale, path) == (2, "primary")
        assert phase3.unseal(t_stale) == b"stale instance"
    else:
        # Data keys are in memory, so Vault cannot stop it: its token is refused by up-to-date peers
        # (docs/vault.md: in datakey mode only the ring's retire gate protects, so reload every instance).
        assert inspect_version(t_stale, path) == (1, "retired")
        with pytest.raises(InvalidRequestState, match="retired kid"):
            phase3.unseal(t_stale)

    # A second rotation starts from v2.
    cli_ok("rotate", "begin", path=path, env=env)
    assert openbao.key_info(transit_key)["latest_version"] == 3
    assert inspect_version(VaultTransitCodec(path, audience="billing").seal(b"x"), path) == (2, "primary")


def test_a_server_token_cannot_rotate_the_transit_key(
    openbao: OpenBao, transit_key: str, tmp_path: Path, bao_env: dict[str, str]
) -> None:
    """docs/vault.md: servers get encrypt/decrypt/read only; rotate and config belong to the deploy role.
    A server token cannot run `rotate begin`: exit 2, the message names the missing capability."""
    path = tmp_path / "ring.json"
    create_ring(FileKeystore(path), codec=CodecSpec("vault-transit", {"key": transit_key, "mode": "remote"}))
    policy = (
        f'path "transit/encrypt/{transit_key}" {{ capabilities = ["update"] }}\n'
        f'path "transit/decrypt/{transit_key}" {{ capabilities = ["update"] }}\n'
        f'path "transit/keys/{transit_key}" {{ capabilities = ["read"] }}\n'
    )
    openbao.api("PUT", f"sys/policies/acl/srv-{transit_key}", {"policy": policy})
    token = openbao.api("POST", "auth/token/create", {"policies": [f"srv-{transit_key}"], "ttl": "10m"})["auth"]
    assert isinstance(token, dict)
    server_env = {**bao_env, "BAO_TOKEN": token["client_token"]}
    refused = run_cli("rotate", "begin", keystore=path, env=server_env)
    assert refused.code == 2
    assert f"needs update on transit/keys/{transit_key}/rotate" in refused.err
    assert token["client_token"] not in refused.err
    assert openbao.key_info(transit_key)["latest_version"] == 1
