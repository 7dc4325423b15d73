"""The sidecar's HTTP API as a client sees it: statuses, bodies, auth and audience scoping.

One sidecar process (uvicorn, free loopback port) serves the whole module.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator

import pytest

from mrtr_keys.changes.create import create_ring
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.ring.model import KeyState
from mrtr_keys.service import schemas
from mrtr_keys.service.clients import load_registry, remove_client
from mrtr_keys.service.config import DEFAULT_MAX_BATCH_ITEMS, DEFAULT_MAX_BODY_BYTES
from mrtr_keys.token import MAX_TOKEN_CHARS
from tests.fixtures.sidecar import Sidecar, start_sidecar

AUDIENCES = ("billing", "billing-admin", "bill", "Billing")


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


class Env:
    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self.all_secret = sidecar.add_client("all", AUDIENCES)
        self.billing_secret = sidecar.add_client("billing", ["billing"])
        self.sealer_secret = sidecar.add_client("sealer", ["billing"], ops=["seal"])
        self.all = sidecar.http(self.all_secret)
        self.billing = sidecar.http(self.billing_secret)
        self.sealer = sidecar.http(self.sealer_secret)
        self.anon = sidecar.http()

    def seal(self, payload: bytes = b"state", audience: str = "billing") -> str:
        r = self.all.post("/v1/seal", json={"audience": audience, "payload": b64u(payload)})
        assert r.status_code == 200, r.text
        token: str = r.json()["token"]
        return token


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("sidecar-api")
    ring = root / "keyring.json"
    create_ring(FileKeystore(ring))
    s = start_sidecar(ring, workdir=root, reload_interval=0.2)
    try:
        yield Env(s)
    finally:
        s.stop()


def test_seal_then_unseal_round_trips_bytes_and_names_the_kid(env: Env) -> None:
    """POST /v1/seal {audience, payload} -> {token, kid}; /v1/unseal gives the bytes back."""
    payload = bytes(range(256))
    r = env.billing.post("/v1/seal", json={"audience": "billing", "payload": b64u(payload)})
    assert r.status_code == 200
    sealed = r.json()
    primary = FileKeystore(env.sidecar.keystore).load().primary.kid
    assert sealed["kid"] == primary and sealed["token"].startswith("mk2.")
    r = env.billing.post("/v1/unseal", json={"audience": "billing", "token": sealed["token"]})
    assert r.status_code == 200
    assert r.json() == {"payload": b64u(payload), "kid": primary}


def test_auth_matrix(env: Env) -> None:
    """No credentials or a wrong secret -> 401; a known client outside its grant -> 403."""
    body = {"audience": "billing", "payload": b64u(b"x")}
    assert env.anon.post("/v1/seal", json=body).status_code == 401
    wrong = env.sidecar.http("mks_" + "A" * 43)
    r = wrong.post("/v1/seal", json=body)
    assert (r.status_code, r.json()) == (401, {"error": "unauthorized"})
    assert r.headers["www-authenticate"].startswith("Bearer")
    basic = env.sidecar.http()
    assert basic.post("/v1/seal", json=body, headers={"authorization": "Basic Zm9vOmJhcg=="}).status_code == 401
    # other audience
    r = env.billing.post("/v1/seal", json={"audience": "billing-admin", "payload": b64u(b"x")})
    assert (r.status_code, r.json()) == (403, {"error": "forbidden"})
    # other operation: a seal-only client unsealing
    token = env.seal()
    r = env.sealer.post("/v1/unseal", json={"audience": "billing", "token": token})
    assert (r.status_code, r.json()) == (403, {"error": "forbidden"})
    assert env.sealer.post("/v1/seal", json=body).status_code == 200
    # the same rules on the batch routes and /v1/keys
    assert env.anon.post("/v1/seal/batch", json={"items": [body]}).status_code == 401
    assert (
        env.sealer.post("/v1/unseal/batch", json={"items": [{"audience": "billing", "token": token}]}).status_code
        == 403
    )
    assert env.anon.get("/v1/keys").status_code == 401


def test_audience_matrix_is_exact_and_case_sensitive(env: Env) -> None:
    """A token for `billing` never unseals as billing-admin, bill, Billing (all granted), nor without one."""
    token = env.seal(audience="billing")
    for other in ("billing-admin", "bill", "Billing"):
        r = env.all.post("/v1/unseal", json={"audience": other, "token": token})
        assert (r.status_code, r.json()) == (400, {"error": "invalid_token"}), other
    r = env.all.post("/v1/unseal", json={"token": token})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "audience"]
    assert env.all.post("/v1/unseal", json={"audience": "billing", "token": token}).status_code == 200


def test_every_unseal_failure_looks_the_same(env: Env) -> None:
    """Whatever the reason, the same status and the same body (the reason is in the server log only).
    A token under a retired key gets this answer too (tests/e2e/test_sidecar_rotation.py)."""
    store = FileKeystore(env.sidecar.keystore)
    good = env.seal(b"payload")
    ring = store.load()
    unknown_kid = "mk1." + b64u(bytes.fromhex("00000000") + base64.urlsafe_b64decode(good[4:] + "==")[4:])
    candidates = {
        "bad base64 padding": good + "==",
        "non-ASCII text": "mk1.\u00e9t\u00e9" + good[8:],
        "over the token cap": "mk1." + "A" * MAX_TOKEN_CHARS,
        "wrong audience": env.seal(b"payload", audience="Billing"),
        "unknown kid": unknown_kid,
        "valid token plus a space": good + " ",
        "tampered": good[:-2] + ("AA" if good[-2:] != "AA" else "BB"),
        "empty": "",
        "sdk v1 token": "v1." + good[4:],
    }
    assert len(candidates["over the token cap"]) > MAX_TOKEN_CHARS
    assert ring.primary.state is KeyState.PRIMARY
    seen = set()
    for name, token in candidates.items():
        r = env.all.post("/v1/unseal", json={"audience": "billing", "token": token})
        seen.add((r.status_code, r.content))
        assert r.status_code == 400, name
    assert seen == {(400, b'{"error":"invalid_token"}')}
    log = env.sidecar.output()
    for reason in ("malformed", "too long", "unknown kid", "seal"):
        assert f": {reason}\n" in log, reason


def test_oversized_bodies_are_refused_before_parsing(env: Env) -> None:
    """A body over max_body_bytes is 413, from Content-Length or while streaming (chunked)."""
    big = b'{"audience":"billing","token":"' + b"A" * DEFAULT_MAX_BODY_BYTES + b'"}'
    r = env.all.post("/v1/unseal", content=big, headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]) == (413, "body_too_large")

    def chunks() -> Iterator[bytes]:
        yield big[:1000]
        yield big[1000:]

    r = env.all.post("/v1/unseal", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"audience": "billing"}, ["body", "payload"]),
        ({"audience": "billing", "payload": "aGk="}, ["body", "payload"]),
        ({"audience": "billing", "payload": "a+b/"}, ["body", "payload"]),
        ({"audience": "billing", "payload": 12}, ["body", "payload"]),
        ({"audience": "", "payload": "aGk"}, ["body", "audience"]),
        ({"audience": 7, "payload": "aGk"}, ["body", "audience"]),
        ({"audience": "billing", "payload": "aGk", "ttl": 5}, ["body", "ttl"]),
        ({"audience": "billing", "payload": b64u(b"x" * (schemas.MAX_PAYLOAD_BYTES + 1))}, ["body", "payload"]),
        ([1, 2], ["body"]),
    ],
)
def test_invalid_fields_are_422_naming_the_field(env: Env, body: object, loc: list[str]) -> None:
    """Invalid fields are 422 with a message naming the field (values are never echoed)."""
    r = env.all.post("/v1/seal", json=body)
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert detail[0]["loc"] == loc
    assert "aGk" not in r.text


def test_batch_mixes_good_and_bad_items(env: Env) -> None:
    """One result per item in order; a bad item gets {error} and never fails the others."""
    items = [
        {"audience": "billing", "payload": b64u(b"one")},
        {"audience": "billing-admin", "payload": b64u(b"two")},  # not granted to this client
        {"audience": "billing", "payload": "not base64!"},
        "not an object",
        {"audience": "billing", "payload": b64u(b"")},
    ]
    r = env.billing.post("/v1/seal/batch", json={"items": items})
    assert r.status_code == 200
    results = r.json()["results"]
    assert [sorted(x) for x in results] == [
        ["kid", "token"],
        ["error"],
        ["detail", "error"],
        ["detail", "error"],
        ["kid", "token"],
    ]
    assert results[1] == {"error": "forbidden"}
    assert results[2]["detail"].startswith("items[2].payload")
    tokens = [results[0]["token"], "garbage", results[4]["token"], results[0]["token"] + " "]
    r = env.billing.post("/v1/unseal/batch", json={"items": [{"audience": "billing", "token": t} for t in tokens]})
    out = r.json()["results"]
    assert out[0]["payload"] == b64u(b"one") and out[2]["payload"] == ""
    assert out[1] == out[3] == {"error": "invalid_token"}


def test_batch_size_is_capped(env: Env) -> None:
    """A documented maximum batch size (max_batch_items, default 256); empty is invalid too."""
    item = {"audience": "billing", "payload": b64u(b"x")}
    assert env.all.post("/v1/seal/batch", json={"items": [item] * DEFAULT_MAX_BATCH_ITEMS}).status_code == 200
    for items in ([item] * (DEFAULT_MAX_BATCH_ITEMS + 1), []):
        r = env.all.post("/v1/seal/batch", json={"items": items})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "items"]


def test_keys_health_ready_and_metrics(env: Env) -> None:
    """/v1/keys without material; /healthz, /readyz, /metrics need no secret and reveal no secrets."""
    ring = FileKeystore(env.sidecar.keystore).load()
    keys = env.all.get("/v1/keys").json()
    assert keys["generation"] == ring.generation
    assert [k["kid"] for k in keys["keys"]] == [k.kid for k in ring.keys]
    assert "material" not in env.all.get("/v1/keys").text
    assert env.anon.get("/healthz").json() == {"status": "ok"}
    ready = env.anon.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    env.seal()
    metrics = env.anon.get("/metrics")
    assert metrics.status_code == 200
    text = metrics.text
    assert 'mrtr_sidecar_requests_total{audience="billing",op="seal",outcome="ok"}' in text
    assert "mrtr_sidecar_request_duration_seconds_bucket" in text
    assert f"mrtr_sidecar_ring_generation {float(ring.generation)}" in text
    for secret in (env.all_secret, env.billing_secret, "all", "sealer"):
        assert f'"{secret}"' not in text and env.all_secret not in text


def test_openapi_documents_the_routes_and_models(env: Env) -> None:
    """The app serves its OpenAPI; the documented request models are the ones the routes accept."""
    doc = env.anon.get("/openapi.json").json()
    for path in ("/v1/seal", "/v1/unseal", "/v1/seal/batch", "/v1/unseal/batch", "/v1/keys", "/readyz"):
        assert path in doc["paths"]
    schemas_ = doc["components"]["schemas"]
    assert set(schemas_["SealRequest"]["properties"]) == {"audience", "payload"}
    assert set(schemas_["UnsealRequest"]["properties"]) == {"audience", "token"}
    assert schemas_["SealRequest"]["additionalProperties"] is False


def test_clients_added_and_removed_are_picked_up_without_restart(env: Env) -> None:
    """The service picks up added and removed clients without a restart."""
    pid = env.sidecar.proc.pid
    secret = env.sidecar.add_client("late", ["billing"])
    http = env.sidecar.http(secret)
    assert http.post("/v1/seal", json={"audience": "billing", "payload": "eA"}).status_code == 200
    remove_client(env.sidecar.clients, "late")
    assert load_registry(env.sidecar.clients).get("late") is None
    deadline = time.monotonic() + 10
    while http.post("/v1/seal", json={"audience": "billing", "payload": "eA"}).status_code != 401:
        assert time.monotonic() < deadline, "removed client still accepted"
        time.sleep(0.05)
    assert env.sidecar.proc.poll() is None and env.sidecar.proc.pid == pid


def test_registry_stores_only_a_hash_mode_0600(env: Env) -> None:
    """The service stores only a hash of each secret; the registry file is private."""
    text = env.sidecar.clients.read_text()
    assert env.all_secret not in text and env.billing_secret not in text
    assert env.sidecar.clients.stat().st_mode & 0o777 == 0o600


def test_nan_and_infinity_are_not_json(env: Env) -> None:
    """Strict JSON (RFC 8259): NaN / Infinity literals are 422, never parsed as numbers."""
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e12"):
        r = env.all.post(
            "/v1/seal",
            content=b'{"audience":"billing","payload":' + literal + b"}",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 422


def test_unknown_path_and_method(env: Env) -> None:
    assert env.all.get("/v1/seal").status_code == 405
    assert env.all.post("/v1/nope", json={}).status_code == 404
