"""One request core: the fast ASGI path, the FastAPI routes and the documented models agree.

The app runs in process (Starlette's test client, no lifespan) over a real key ring and client registry;
the audit sink is a plain list of the events it was called with. The same random bodies, valid and not,
go through the fast path (`SidecarApp.__call__`) and through the FastAPI routes (the fast table emptied,
and the app mounted under a prefix, as a library user would); the status and body must be the same. The
pydantic models in `mrtr_keys.service.schemas` must accept exactly the bodies the routes do not refuse
with 422.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from mrtr_keys.changes.create import create_ring
from mrtr_keys.keystores.file import FileKeystore
from mrtr_keys.service import schemas
from mrtr_keys.service.app import SidecarApp, create_app
from mrtr_keys.service.clients import add_client
from mrtr_keys.service.config import ServiceConfig

ROUTES = ("/v1/seal", "/v1/unseal", "/v1/seal/batch", "/v1/unseal/batch")
AUDIENCES = ("billing", "other")


def b64u(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


class Events(list[dict[str, Any]]):
    """An audit sink that keeps every call (the sidecar's audit seam, docs/sidecar.md)."""

    def __call__(self, **event: Any) -> None:
        self.append(event)


class InProcess:
    def __init__(self, root: Path) -> None:
        ring = root / "keyring.json"
        create_ring(FileKeystore(ring))
        _, self.secret = add_client(root / "clients.json", "billing", audiences=["billing"])
        self.events = Events()
        self.app: SidecarApp = create_app(ServiceConfig(max_batch_items=8), keystore=str(ring), audit=self.events)
        self.fast_table = dict(self.app.fast_routes)
        self.client = TestClient(self.app, raise_server_exceptions=True)
        self.mounted = TestClient(Starlette(routes=[Mount("/sealing", app=self.app)]))
        self.token = self.post("/v1/seal", {"audience": "billing", "payload": b64u(b"state")})[1]["token"]

    def post(
        self, route: str, body: Any, *, fast: bool = True, raw: bytes | None = None, secret: str | None = None
    ) -> tuple[int, Any, list[dict[str, Any]]]:
        """(status, JSON body, audit events) of one POST, through the fast path or the FastAPI route."""
        self.app.fast_routes = self.fast_table if fast else {}
        content = raw if raw is not None else orjson.dumps(body)
        headers = {"content-type": "application/json", "authorization": f"Bearer {secret or self.secret}"}
        start = len(self.events)
        try:
            r = self.client.post(route, content=content, headers=headers)
        finally:
            self.app.fast_routes = self.fast_table
        return (
            r.status_code,
            r.json(),
            [{k: v for k, v in e.items() if k != "duration_ms"} for e in self.events[start:]],
        )


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcess]:
    yield InProcess(tmp_path_factory.mktemp("parity"))


def _normalise(route: str, body: Any, events: list[dict[str, Any]]) -> tuple[Any, Any]:
    """Sealed tokens differ by their random nonce: compare them by shape (and events by their other fields)."""
    if route.startswith("/v1/seal") and isinstance(body, dict):
        for entry in body.get("results", [body]):
            if isinstance(entry, dict) and "token" in entry:
                assert entry["token"].startswith("mk2.")
                entry["token"] = "<sealed>"
        events = [{**e, "token": "<sealed>" if e["outcome"] == "ok" else e["token"]} for e in events]
    return body, events


json_scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=12)
b64_text = st.binary(max_size=48).map(b64u)
field_values = json_scalars | b64_text | st.sampled_from(["billing", "other", "", "a" * 257, "aGk=", "a+b/", "é"])


def _item(second: str) -> st.SearchStrategy[Any]:
    valid = st.fixed_dictionaries({"audience": st.sampled_from(AUDIENCES), second: b64_text})
    loose = st.dictionaries(st.sampled_from(["audience", "payload", "token", "ttl"]), field_values, max_size=3)
    return valid | loose | json_scalars


def _body(route: str) -> st.SearchStrategy[Any]:
    second = "payload" if route.startswith("/v1/seal") else "token"
    item = _item(second)
    if route.endswith("batch"):
        batch = st.fixed_dictionaries({"items": st.lists(item, max_size=10)})
        return batch | st.dictionaries(st.sampled_from(["items", "extra"]), st.lists(item, max_size=3)) | item
    return item | st.lists(json_scalars, max_size=2)


RAW_BODIES = [
    b"",
    b"not json",
    b'{"audience":"billing","payload":NaN}',
    b'{"audience":"billing","token":"mk1.\\ud800"}',
    b'{"audience":"bill\\udc00","token":"x"}',
    b'{"audience":"billing","payload":"\\ud800"}',
    b'{"items":[{"audience":"billing","token":"\\ud83d"}]}',
    b"\xff\xfe",
    b"[" * 5000,
]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fast_path_and_fastapi_route_answer_alike(sidecar: InProcess, data: st.DataObject) -> None:
    """The same body gets the same status, body and audit events on both paths."""
    route = data.draw(st.sampled_from(ROUTES))
    body = data.draw(_body(route))
    if route.startswith("/v1/unseal") and data.draw(st.booleans()):
        body = {"audience": data.draw(st.sampled_from(AUDIENCES)), "token": sidecar.token}
        if route.endswith("batch"):
            body = {"items": [body, {**body, "token": sidecar.token[:-1]}]}
    fast = sidecar.post(route, body)
    slow = sidecar.post(route, body, fast=False)
    assert fast[0] == slow[0]
    assert _normalise(route, fast[1], fast[2]) == _normalise(route, slow[1], slow[2])
    _check_model(route, body, fast[0], fast[1])


def _check_model(route: str, body: Any, status: int, answer: Any) -> None:
    """The documented model accepts `body` exactly when the route did not refuse it (or an item) with 422."""
    model: type[BaseModel] = schemas.REQUEST_MODELS[route]
    try:
        model.model_validate(body, strict=True)
        accepted = True
    except ValidationError:
        accepted = False
    if not route.endswith("batch"):
        assert accepted == (status != 422), (body, status, answer)
        return
    item_model = schemas.SealRequest if route.startswith("/v1/seal") else schemas.UnsealRequest
    if status == 422:
        assert not accepted, body
        return
    assert status == 200, answer
    valid_items = []
    for item, result in zip(body["items"], answer["results"], strict=True):
        try:
            item_model.model_validate(item, strict=True)
            ok = True
        except ValidationError:
            ok = False
        assert ok == (result.get("error") != "invalid_request"), (item, result)
        valid_items.append(ok)
    # the model's batch size cap is the default (256); this app allows 8, so compare item validity only
    assert accepted == all(valid_items)


@pytest.mark.parametrize("raw", RAW_BODIES)
@pytest.mark.parametrize("route", ROUTES)
def test_raw_bodies_answer_alike(sidecar: InProcess, route: str, raw: bytes) -> None:
    """Not JSON, NaN, lone surrogates, invalid UTF-8, deep nesting: both paths give the same answer."""
    fast = sidecar.post(route, None, raw=raw)
    slow = sidecar.post(route, None, raw=raw, fast=False)
    assert fast[:2] == slow[:2]
    assert fast[0] in (200, 400, 422)


def test_a_lone_surrogate_token_gets_the_one_400(sidecar: InProcess) -> None:
    """A token holding a lone surrogate is a bad token like any other: 400 invalid_token.

    JSON allows the escape ``\\ud800`` (RFC 8259 section 8.2 leaves such strings to the implementation);
    orjson refuses them, so the body is parsed again by the standard library and reaches the codec."""
    for raw in (b'{"audience":"billing","token":"mk1.\\ud800"}', b'{"audience":"billing","token":"\\udfff"}'):
        assert sidecar.post("/v1/unseal", None, raw=raw)[:2] == (400, {"error": "invalid_token"})
    status, answer, _ = sidecar.post(
        "/v1/unseal/batch", None, raw=b'{"items":[{"audience":"billing","token":"\\ud800"}]}'
    )
    assert (status, answer) == (200, {"results": [{"error": "invalid_token"}]})


def test_unauthenticated_and_oversized_answer_alike(sidecar: InProcess) -> None:
    """401 (with its WWW-Authenticate) and 413 come from the same core on both paths."""
    body = {"audience": "billing", "payload": "eA"}
    for fast in (True, False):
        assert sidecar.post("/v1/seal", body, fast=fast, secret="mks_wrong")[:2] == (401, {"error": "unauthorized"})
        big = sidecar.post("/v1/seal", None, fast=fast, raw=b"x" * (ServiceConfig().max_body_bytes + 1))
        assert big[0] == 413 and big[1]["error"] == "body_too_large"


def test_the_fastapi_route_serves_when_the_app_is_mounted(sidecar: InProcess) -> None:
    """Mounted under a prefix, requests reach the FastAPI routes (not the fast table) and still round-trip."""
    auth = {"authorization": f"Bearer {sidecar.secret}"}

    async def not_this_way(scope: Any, receive: Any) -> Any:
        raise AssertionError("the fast table answered a mounted request")

    sidecar.app.fast_routes = dict.fromkeys(ROUTES, not_this_way)
    try:
        r = sidecar.mounted.post(
            "/sealing/v1/seal", json={"audience": "billing", "payload": b64u(b"mounted")}, headers=auth
        )
    finally:
        sidecar.app.fast_routes = sidecar.fast_table
    assert r.status_code == 200, r.text
    token = r.json()["token"]
    r = sidecar.mounted.post("/sealing/v1/unseal", json={"audience": "billing", "token": token}, headers=auth)
    assert r.json()["payload"] == b64u(b"mounted")
    r = sidecar.mounted.post("/sealing/v1/unseal", json={"audience": "billing", "token": token + "A"}, headers=auth)
    assert (r.status_code, r.json()) == (400, {"error": "invalid_token"})
