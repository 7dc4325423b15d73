"""Request and response shapes of the sidecar API, as pydantic models for the OpenAPI document.

The routes parse with orjson and check fields by hand (`mrtr_keys.service.validation`) so a seal costs
microseconds; these models are the documented contract, built on the same rules (the payload check is
the same function), and tests/service/test_parity.py checks that a body one accepts the other accepts
too. Bytes travel as unpadded base64url (RFC 4648 section 5); tokens are the codec's own text.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from mrtr_keys.changes.scope import MAX_AUDIENCE_CHARS
from mrtr_keys.codecs.aesgcm import MAX_PAYLOAD_BYTES
from mrtr_keys.service.config import DEFAULT_MAX_BATCH_ITEMS
from mrtr_keys.service.validation import MAX_PAYLOAD_B64_CHARS, decode_payload

__all__ = ["MAX_PAYLOAD_BYTES"]


def _payload(text: str) -> str:
    refused = decode_payload(text)
    if isinstance(refused, str):
        raise ValueError(refused)
    return text


Payload = Annotated[
    str,
    Field(
        max_length=MAX_PAYLOAD_B64_CHARS,
        pattern=r"^[A-Za-z0-9_-]*$",
        description=f"Unpadded, canonical base64url (RFC 4648 section 5) of at most {MAX_PAYLOAD_BYTES} bytes.",
    ),
    AfterValidator(_payload),
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SealRequest(_Strict):
    audience: str = Field(min_length=1, max_length=MAX_AUDIENCE_CHARS, description="Exact, case-sensitive.")
    payload: Payload


class SealResponse(BaseModel):
    token: str
    kid: str | None = Field(description="The key that sealed (8 hex characters for ring codecs).")


class UnsealRequest(_Strict):
    audience: str = Field(min_length=1, max_length=MAX_AUDIENCE_CHARS)
    token: str


class UnsealResponse(BaseModel):
    payload: str = Field(description="Unpadded base64url.")
    kid: str | None


class ItemError(BaseModel):
    error: Literal["invalid_token", "forbidden", "invalid_request", "backend_unavailable", "internal"]
    detail: str | None = Field(default=None, description="For invalid_request: which field and why.")


class SealBatchRequest(_Strict):
    items: list[SealRequest] = Field(
        min_length=1, max_length=DEFAULT_MAX_BATCH_ITEMS, description="1 to max_batch_items (default 256) items."
    )


class UnsealBatchRequest(_Strict):
    items: list[UnsealRequest] = Field(
        min_length=1, max_length=DEFAULT_MAX_BATCH_ITEMS, description="1 to max_batch_items (default 256) items."
    )


class SealBatchResponse(BaseModel):
    results: list[SealResponse | ItemError] = Field(description="One per item, same order.")


class UnsealBatchResponse(BaseModel):
    results: list[UnsealResponse | ItemError] = Field(description="One per item, same order.")


class ErrorBody(BaseModel):
    error: str = Field(
        description="unauthorized (401), forbidden (403), invalid_token (400, every unseal failure), "
        "body_too_large (413), invalid_request (422), backend_unavailable (503), internal (500)."
    )
    detail: list[dict[str, Any]] | None = None


class KeyInfo(BaseModel):
    kid: str
    state: Literal["verify", "primary", "retired"]
    created_at: str | None
    promoted_at: str | None
    demoted_at: str | None
    retired_at: str | None


class KeysResponse(BaseModel):
    ring_id: str
    generation: int
    ttl_seconds: float
    audiences: list[str]
    codec: str
    keys: list[KeyInfo]
    reload_error: str | None


class WatcherStatus(BaseModel):
    """The ring watcher's liveness: stuck when no keystore check completed in 3 intervals."""

    interval_seconds: float
    last_check: str | None
    stuck_since: str | None


class ReadyResponse(BaseModel):
    ready: bool
    generation: int | None
    reason: str | None = None
    reload_error: str | None = None
    watcher: WatcherStatus | None = None
    down: dict[str, str | None] | None = None
    """Components down (``codec``, ``audit``, ``replay``) -> since when (event time form), if any."""
    key_usage: dict[str, Any] | None = None
    """Authenticated callers only: each usable key's seals (fleet-wide from the presence store, else this
    process's), seal budget, fraction used and, from 50 %, the warning sentence (docs/rotation.md)."""
    wrapping_key: dict[str, Any] | None = None
    """A KMS-envelope or Vault data-key ring's wrapping-key check (`mrtr_keys.codecs.kek`): ``wrapping_key``,
    ``state`` (``ok``, ``unreachable``, ``revoked``, ``unchecked``), ``closed`` (why it fails closed),
    ``closed_since``, ``error`` (an outage), ``every_seconds``, ``last_ok``, ``last_check``."""


REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/seal": SealRequest,
    "/v1/unseal": UnsealRequest,
    "/v1/seal/batch": SealBatchRequest,
    "/v1/unseal/batch": UnsealBatchRequest,
}
RESPONSE_MODELS: dict[str, type[BaseModel]] = {
    "/v1/seal": SealResponse,
    "/v1/unseal": UnsealResponse,
    "/v1/seal/batch": SealBatchResponse,
    "/v1/unseal/batch": UnsealBatchResponse,
}
