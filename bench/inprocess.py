"""Part 1: in-process seal/unseal of a 300-byte envelope, every codec next to its anchors.

Subjects: the local codec (a new ring: ``mk2``, AES-256-GCM-SIV) and the same over an ``mk1`` ring
(AES-256-GCM, rings made before 0.2.0), the KMS data-key codec (on moto server, started here) and the
Vault data-key codec (on an OpenBao dev server, started here). Anchors: the MCP SDK's
built-in `AESGCMRequestStateCodec`, and raw `AESGCM.encrypt` + `decrypt` with a fresh
``os.urandom(12)`` nonce (the limit for any AES-GCM token codec in Python).
The data-key codecs reach their key service through a `CountingProxy`, so the number of
remote calls made while tokens are sealed and unsealed is counted, not assumed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import Settings, envelope_payload
from bench.report import Row, spread_of
from bench.services import AUDIENCE, CountingProxy, Services, module_available
from bench.timing import Loop, interleaved, median, pair, paired_ratio

PART = "inprocess"
OPS = ("seal", "unseal", "seal+unseal")
SDK = "SDK built-in"
RAW = "raw AES-GCM"
LOCAL = "local"
KMS = "KMS datakey"
VAULT_DK = "Vault datakey"
B64 = "base64url encode+decode only"
NOSPANS = "local without the tracing wrapper"
TRACED = "local seal+unseal, OTel API, no tracer provider"
NOFENCE = "local without the lease check"
FENCED = "local seal+unseal, self-fencing lease check"
LOCAL_MK1 = "local mk1"
UNCOUNTED = "local without counting"
COUNTED = "local seal+unseal, seal counting"
LARGE_BYTES = 16 * 1024
LARGE = "local seal+unseal, 16 KiB payload"
LARGE_MK1 = "local mk1 seal+unseal, 16 KiB payload"


@dataclass
class Subject:
    name: str
    codec: Any | None = None
    proxy: CountingProxy | None = None
    missing: str = ""


def codec_loops(codec: Any, payload: bytes) -> dict[str, Loop]:
    seal, unseal = codec.seal, codec.unseal
    token = seal(payload)
    assert unseal(token) == payload

    def seal_loop(n: int) -> None:
        for _ in range(n):
            seal(payload)

    def unseal_loop(n: int) -> None:
        for _ in range(n):
            unseal(token)

    def both_loop(n: int) -> None:
        for _ in range(n):
            unseal(seal(payload))

    return {"seal": seal_loop, "unseal": unseal_loop, "seal+unseal": both_loop}


def raw_loops(payload: bytes) -> dict[str, Loop]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(os.urandom(32))
    enc, dec, rnd = aead.encrypt, aead.decrypt, os.urandom
    aad = b"v1." + os.urandom(4)
    nonce0 = rnd(12)
    sealed0 = enc(nonce0, payload, aad)

    def seal_loop(n: int) -> None:
        for _ in range(n):
            nonce = rnd(12)
            enc(nonce, payload, aad)

    def unseal_loop(n: int) -> None:
        for _ in range(n):
            dec(nonce0, sealed0, aad)

    def both_loop(n: int) -> None:
        for _ in range(n):
            nonce = rnd(12)
            dec(nonce, enc(nonce, payload, aad), aad)

    return {"seal": seal_loop, "unseal": unseal_loop, "seal+unseal": both_loop}


def b64_loops(payload: bytes) -> dict[str, Loop]:
    """The token framing alone (strict base64url of kid+nonce+ciphertext+tag, both ways): the floor
    any codec pays on top of raw AES-GCM for a text token."""
    from mrtr_keys.token import b64u_decode, b64u_encode

    body = os.urandom(4 + 12 + len(payload) + 16)
    text = b64u_encode(body)

    def both_loop(n: int) -> None:
        for _ in range(n):
            b64u_encode(body)
            b64u_decode(text)

    return {"seal+unseal": both_loop}


def _local(workdir: Path, key_format: str = "mk2") -> Any:
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.factory import open_codec
    from mrtr_keys.keystores.file import FileKeystore

    path = workdir / f"local-ring-{key_format}.json"
    create_ring(FileKeystore(path), key_format=key_format)
    return open_codec(path, audience=AUDIENCE)


def _seal_today(self: Any, payload: bytes) -> str:
    """`KeyRingCodec.seal` before the lease check."""
    return self._seal(payload)  # type: ignore[no-any-return]


def _unseal_today(self: Any, token: str) -> bytes:
    """`KeyRingCodec.unseal` before the lease check and the unknown-kid look."""
    return self._unseal(token)  # type: ignore[no-any-return]


LEASE_ROUNDS = 400
"""Rounds of the lease pair (`bench.timing.pair`, 500 seal+unseal a sample; ``--quick``: 40 of 50): its
per-round ratios spread by several per cent on a shared host, around a true difference of 2 to 4 %."""


def lease_pair(workdir: Path, payload: bytes, *, quick: bool) -> dict[str, list[float]]:
    """The self-fencing lease check (mrtr_keys.codecs.fence), timed as a pair of its own: a local codec as
    opened vs another opened the same way whose seal/unseal are what they were before the lease (one method
    call to the installed core). Name -> per-round µs of one seal+unseal."""
    fenced = open_codec_for_bench(workdir, "a")
    today = open_codec_for_bench(workdir, "b")
    today.__class__ = type("WithoutLease", (type(today),), {"seal": _seal_today, "unseal": _unseal_today})
    with_lease, without = pair(
        codec_loops(fenced, payload)["seal+unseal"],
        codec_loops(today, payload)["seal+unseal"],
        rounds=LEASE_ROUNDS // 10 if quick else LEASE_ROUNDS,
        inner=50 if quick else 500,
    )
    return {FENCED: with_lease, NOFENCE: without}


def lease_row(r: dict[str, list[float]]) -> Row:
    """The ``fenced`` row from `lease_pair`: paired ratio against the codec without the check, with the spread
    of the per-round ratios and the added time in ns."""
    ratios = [a / b for a, b in zip(r[FENCED], r[NOFENCE], strict=True)]
    row = Row(PART, FENCED, "µs", median(r[FENCED]), spread_of(r[FENCED]), NOFENCE, samples=r[FENCED])
    row.ratio = paired_ratio(r[FENCED], r[NOFENCE])
    added = median([(a - b) * 1000 for a, b in zip(r[FENCED], r[NOFENCE], strict=True)])
    row.note = (
        "one monotonic clock read and one comparison a seal and an unseal (issue 23); "
        f"{len(ratios)} rounds, per-round ratio IQR {spread_of(ratios):.3f}, {added:+.0f} ns a seal+unseal"
    )
    return row.decide(row.ratio, "<= 1.02x")


def _uncounted_core(core: Any) -> Any:
    """A copy of `core` (an `AESGCMTokenCore`) whose seal and unseal are the token core's before seal counting:
    the same steps without the tally's ``next()``, its mark comparison, or the unseal count."""
    from mrtr_keys.codecs import aesgcm as A

    class Uncounted(type(core)):  # type: ignore[misc]
        __slots__ = ()

        def seal(self, payload: bytes) -> str:
            if len(payload) > A.MAX_PAYLOAD_BYTES:
                raise A.MrtrKeysError("payload too long")
            encrypt, aad, raw_kid, kid, prefix, _, _ = self._sealer
            nonce = A._take_nonce()
            token: str = prefix + A.b64u_encode(raw_kid + nonce + encrypt(nonce, payload, aad))
            if self._observer is not None:
                self._observer.sealed(kid, token)
            return token

        def unseal(self, token: str) -> bytes:
            if type(token) is not str or len(token) > A.MAX_TOKEN_CHARS or not token.startswith(A._PREFIXES):
                self._rejected(None, token, "malformed")
            raw = A.b64u_decode(token[A._PREFIX_LEN :])
            if len(raw) < A._MIN_RAW:
                self._rejected(None, token, "malformed")
            raw_kid = raw[: A.KID_BYTES]
            entry = self._ring.get(raw_kid)
            if entry is None:
                self._rejected(raw_kid, token, "unknown kid")
            decrypt, aad, kid, prefix, _ = entry
            if not token.startswith(prefix):
                self._rejected(raw_kid, token, "other format")
            payload: bytes = decrypt(raw[A.KID_BYTES : A._NONCE_END], raw[A._NONCE_END :], aad)
            if self._observer is not None:
                self._observer.unsealed(kid, token)
            return payload

    copy = object.__new__(Uncounted)
    for name in A.AESGCMTokenCore.__slots__:
        setattr(copy, name, getattr(core, name))
    return copy


def counting_pair(workdir: Path, payload: bytes, *, quick: bool) -> dict[str, list[float]]:
    """Seal counting on the hot path (mrtr_keys.codecs.usage, issue 36), timed as a pair of its own: a local
    codec as opened (its core counts every seal and unseal) vs another whose installed core is the same without
    counting (`_uncounted_core`). Name -> per-round µs of one seal+unseal."""
    counted = open_codec_for_bench(workdir, "counted")
    plain = open_codec_for_bench(workdir, "uncounted")
    plain._install(plain.ring, _uncounted_core(plain._core))
    with_count, without = pair(
        codec_loops(counted, payload)["seal+unseal"],
        codec_loops(plain, payload)["seal+unseal"],
        rounds=LEASE_ROUNDS // 10 if quick else LEASE_ROUNDS,
        inner=50 if quick else 500,
    )
    return {COUNTED: with_count, UNCOUNTED: without}


def counting_row(r: dict[str, list[float]]) -> Row:
    """The ``seal counting`` row from `counting_pair`: paired ratio against the core without counting."""
    ratios = [a / b for a, b in zip(r[COUNTED], r[UNCOUNTED], strict=True)]
    row = Row(PART, COUNTED, "µs", median(r[COUNTED]), spread_of(r[COUNTED]), UNCOUNTED, samples=r[COUNTED])
    row.ratio = paired_ratio(r[COUNTED], r[UNCOUNTED])
    added = median([(a - b) * 1000 for a, b in zip(r[COUNTED], r[UNCOUNTED], strict=True)])
    row.note = (
        "one itertools.count next() and one comparison a seal, one next() an unseal (no lock, no remote call); "
        f"{len(ratios)} rounds, per-round ratio IQR {spread_of(ratios):.3f}, {added:+.0f} ns a seal+unseal"
    )
    return row.decide(row.ratio, "<= 1.05x")


def large_pair(workdir: Path, *, quick: bool) -> dict[str, list[float]]:
    """mk2 against mk1 with a 16 KiB payload (a large request state), timed as a pair: the 300-byte rows hide
    how each cipher's cost grows with the payload. Name -> per-round µs of one seal+unseal."""
    payload = os.urandom(LARGE_BYTES)
    (workdir / "large").mkdir(exist_ok=True)
    mk2, mk1 = _local(workdir / "large", "mk2"), _local(workdir / "large", "mk1")
    a, b = pair(
        codec_loops(mk2, payload)["seal+unseal"],
        codec_loops(mk1, payload)["seal+unseal"],
        rounds=10 if quick else 40,
        inner=5 if quick else 50,
    )
    return {LARGE: a, LARGE_MK1: b}


def large_row(r: dict[str, list[float]]) -> Row:
    """The 16 KiB row from `large_pair` (information: no target)."""
    row = Row(PART, LARGE, "µs", median(r[LARGE]), spread_of(r[LARGE]), LARGE_MK1, samples=r[LARGE])
    row.ratio = paired_ratio(r[LARGE], r[LARGE_MK1])
    extra = (median(r[LARGE]) - median(r[LARGE_MK1])) / (2 * LARGE_BYTES) * 1000
    row.note = (
        f"mk2 against mk1 ({median(r[LARGE_MK1]):.1f} µs); AES-256-GCM-SIV through cryptography costs about "
        f"{extra:.1f} ns more a payload byte, each way, than AES-256-GCM here"
    )
    return row


def open_codec_for_bench(workdir: Path, name: str) -> Any:
    """Another local codec over its own ring, opened as `_local` opens one."""
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.factory import open_codec
    from mrtr_keys.keystores.file import FileKeystore

    path = workdir / f"local-ring-{name}.json"
    create_ring(FileKeystore(path))
    return open_codec(path, audience=AUDIENCE)


def _kms(services: Services) -> Subject:
    if not module_available("mrtr_keys.backends.kms"):
        return Subject(KMS, missing="n/a (not built): mrtr_keys.backends.kms")
    import boto3

    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.factory import open_codec
    from mrtr_keys.keystores.file import FileKeystore
    from mrtr_keys.ring.model import CodecSpec

    moto = services.moto
    proxy = services.proxy(moto.port)
    os.environ.update({**moto.env(), "AWS_ENDPOINT_URL": proxy.url})
    arn = boto3.client("kms").create_key()["KeyMetadata"]["Arn"]
    path = services.workdir / "kms-ring.json"
    create_ring(FileKeystore(path), codec=CodecSpec("kms", {"kms_key_id": arn}))
    return Subject(KMS, open_codec(path, audience=AUDIENCE), proxy)


def _vault_datakey(services: Services) -> Subject:
    if not module_available("mrtr_keys.backends.vault"):
        return Subject(VAULT_DK, missing="n/a (not built): mrtr_keys.backends.vault")
    from bench.vault_remote import vault_ring

    bao = services.bao
    proxy = services.proxy(bao.port)
    os.environ.update({**bao.env(), "VAULT_ADDR": proxy.url, "BAO_ADDR": proxy.url})
    codec = vault_ring(services, name="bench-datakey", mode="datakey")
    return Subject(VAULT_DK, codec, proxy)


def _guarded(name: str, build: Callable[[], Subject]) -> Subject:
    try:
        return build()
    except Exception as exc:  # a module mid-build must not stop the other rows
        return Subject(name, missing=f"n/a (error: {type(exc).__name__}: {str(exc)[:120]})")


def run(services: Services, settings: Settings) -> list[Row]:
    payload = envelope_payload()
    from mcp.server.request_state import AESGCMRequestStateCodec

    subjects = [
        Subject(SDK, AESGCMRequestStateCodec([os.urandom(32)])),
        Subject(LOCAL, _local(services.workdir)),
        Subject(LOCAL_MK1, _local(services.workdir, "mk1")),
        _guarded(KMS, lambda: _kms(services)),
        _guarded(VAULT_DK, lambda: _vault_datakey(services)),
    ]
    live = [s for s in subjects if s.codec is not None]
    loops: dict[str, dict[str, Loop]] = {RAW: raw_loops(payload), B64: b64_loops(payload)}
    for s in live:
        loops[s.name] = codec_loops(s.codec, payload)
    # The tracing wrapper's cost when no provider is set (mrtr_keys.tracing): the local codec as
    # served vs its token core's own bound methods, interleaved in the same run.
    from types import SimpleNamespace

    core = subjects[1].codec._core
    loops[NOSPANS] = {
        "seal+unseal": codec_loops(SimpleNamespace(seal=core.seal, unseal=core.unseal), payload)["seal+unseal"]
    }
    # The self-fencing lease check, timed on its own in more rounds (a ~2 % difference, a 1.02x target).
    fenced = lease_pair(services.workdir, payload, quick=settings.quick)
    counting = counting_pair(services.workdir, payload, quick=settings.quick)
    large = large_pair(services.workdir, quick=settings.quick)
    calls_before = {s.name: s.proxy.requests for s in live if s.proxy is not None}

    results: dict[str, dict[str, list[float]]] = {}
    tokens = 0
    for op in OPS:
        results[op] = interleaved(
            {name: per_op[op] for name, per_op in loops.items() if op in per_op},
            repeats=settings.repeats,
            inner=settings.inner,
        )
        per_subject = settings.inner * settings.repeats + max(1, settings.inner // 10)
        tokens += per_subject * (2 if op == "seal+unseal" else 1)

    rows: list[Row] = []
    for op in OPS:
        r = results[op]
        for name in r:
            if op == "seal+unseal" and name in (KMS, VAULT_DK, NOSPANS):
                continue  # reported below against the local codec, their target's anchor
            anchor = RAW if name in (SDK, B64) else SDK if name != RAW else ""
            row = Row(PART, f"{name} {op}", "µs", median(r[name]), spread_of(r[name]), samples=r[name])
            if anchor:
                row.anchor, row.ratio = anchor, paired_ratio(r[name], r[anchor])
            if op == "seal+unseal" and name == LOCAL:
                row.note = "mk2 (AES-256-GCM-SIV): a new ring's format; docs/token-format.md"
                row.decide(row.ratio, "<= 0.7x")
            rows.append(row)
        if op == "seal+unseal":
            row = Row(PART, f"{LOCAL} {op}", "µs", median(r[LOCAL]), spread_of(r[LOCAL]), RAW)
            row.ratio = paired_ratio(r[LOCAL], r[RAW])
            rows.append(row.decide(row.ratio, "<= 2.0x"))
            row = Row(PART, TRACED, "µs", median(r[LOCAL]), spread_of(r[LOCAL]), NOSPANS)
            row.ratio = paired_ratio(r[LOCAL], r[NOSPANS])
            row.note = "cost of the span wrapper when tracing is off (one call, one attribute test)"
            rows.append(row.decide(row.ratio, "<= 1.1x"))
            rows.append(lease_row(fenced))
            rows.append(counting_row(counting))
            row = Row(PART, f"{LOCAL} {op}", "µs", median(r[LOCAL]), spread_of(r[LOCAL]), LOCAL_MK1)
            row.ratio = paired_ratio(r[LOCAL], r[LOCAL_MK1])
            row.note = "mk2 (AES-256-GCM-SIV, 2^48 seals a key) against mk1 (AES-256-GCM, 2^32)"
            rows.append(row)
            rows.append(large_row(large))
            for s in subjects:
                if s.name in (KMS, VAULT_DK):
                    if s.codec is None:
                        rows.append(Row.missing(PART, f"{s.name} {op}", s.missing, target="<= 1.1x"))
                        continue
                    row = Row(PART, f"{s.name} {op}", "µs", median(r[s.name]), spread_of(r[s.name]), LOCAL)
                    row.ratio = paired_ratio(r[s.name], r[LOCAL])
                    rows.append(row.decide(row.ratio, "<= 1.1x"))
    for s in subjects:
        if s.name not in (KMS, VAULT_DK):
            continue
        name = f"{s.name} remote calls while timing"
        if s.codec is None or s.proxy is None:
            rows.append(Row.missing(PART, name, s.missing, target="== 0 calls"))
            continue
        calls = s.proxy.requests - calls_before[s.name]
        row = Row(PART, name, "calls", float(calls), note=f"over {tokens:,} seals+unseals, counted at a proxy")
        rows.append(row.decide(float(calls), "== 0 calls"))
    return rows
