"""Part 2: the Vault transit codec in remote mode against a bare hvac transit call, same OpenBao server.

Both sides use the same derived transit key (aes256-gcm96) and the same ``context`` (the
audience), on the OpenBao dev server the benchmark started, over loopback HTTP. The codec
adds its token framing and checks; the anchor is
``client.secrets.transit.encrypt_data`` + ``decrypt_data`` and nothing else. Wall time
(the work is mostly waiting for the server), interleaved rounds.
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any

from bench.common import Settings, envelope_payload
from bench.report import Row, spread_of
from bench.services import AUDIENCE, VAULT_TOKEN, Services, module_available
from bench.timing import Loop, interleaved, median, paired_ratio

PART = "vault_remote"


def vault_ring(services: Services, *, name: str, mode: str) -> Any:
    """A derived transit key `name`, a ring for it in `mode`, and the codec opened for `AUDIENCE`.

    Vault's address and token come from the environment (``VAULT_ADDR``/``VAULT_TOKEN``), as
    for every user of the codec; set them before calling.
    """
    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.factory import open_codec
    from mrtr_keys.keystores.file import FileKeystore
    from mrtr_keys.ring.model import CodecSpec

    services.bao.request("POST", f"/v1/transit/keys/{name}", {"derived": True})
    path = services.workdir / f"vault-{mode}-ring.json"
    create_ring(FileKeystore(path), codec=CodecSpec("vault-transit", {"key": name, "mode": mode}))
    return open_codec(path, audience=AUDIENCE)


def run(services: Services, settings: Settings) -> list[Row]:
    names = ("Vault remote seal", "Vault remote unseal", "Vault remote seal+unseal")
    if not module_available("mrtr_keys.codecs.vault_transit"):
        why = "n/a (not built): mrtr_keys.codecs.vault_transit"
        return [Row.missing(PART, n, why, target="<= 1.1x" if "+" in n else "") for n in names]
    import hvac

    bao = services.bao
    os.environ.update(bao.env())
    key = "bench-remote"
    codec = vault_ring(services, name=key, mode="remote")
    client = hvac.Client(url=bao.addr, token=VAULT_TOKEN)
    transit = client.secrets.transit
    payload = envelope_payload()
    plaintext = base64.b64encode(payload).decode()
    context = base64.b64encode(AUDIENCE.encode()).decode()
    ciphertext = transit.encrypt_data(name=key, plaintext=plaintext, context=context)["data"]["ciphertext"]
    token = codec.seal(payload)
    assert codec.unseal(token) == payload

    def hvac_encrypt(n: int) -> None:
        for _ in range(n):
            transit.encrypt_data(name=key, plaintext=plaintext, context=context)

    def hvac_decrypt(n: int) -> None:
        for _ in range(n):
            base64.b64decode(
                transit.decrypt_data(name=key, ciphertext=ciphertext, context=context)["data"]["plaintext"]
            )

    def hvac_both(n: int) -> None:
        for _ in range(n):
            ct = transit.encrypt_data(name=key, plaintext=plaintext, context=context)["data"]["ciphertext"]
            base64.b64decode(transit.decrypt_data(name=key, ciphertext=ct, context=context)["data"]["plaintext"])

    def codec_seal(n: int) -> None:
        for _ in range(n):
            codec.seal(payload)

    def codec_unseal(n: int) -> None:
        for _ in range(n):
            codec.unseal(token)

    def codec_both(n: int) -> None:
        for _ in range(n):
            codec.unseal(codec.seal(payload))

    pairs: list[tuple[str, Loop, str, Loop]] = [
        (names[0], codec_seal, "hvac encrypt", hvac_encrypt),
        (names[1], codec_unseal, "hvac decrypt", hvac_decrypt),
        (names[2], codec_both, "hvac encrypt+decrypt", hvac_both),
    ]
    inner = 20 if settings.quick else 150
    rows: list[Row] = []
    for name, subject, anchor, anchor_loop in pairs:
        r = interleaved(
            {anchor: anchor_loop, name: subject},
            repeats=max(3, settings.repeats // 2),
            inner=inner,
            warmup=10,
            clock=time.perf_counter,
        )
        rows.append(Row(PART, anchor, "µs", median(r[anchor]), spread_of(r[anchor]), samples=r[anchor]))
        row = Row(PART, name, "µs", median(r[name]), spread_of(r[name]), anchor, paired_ratio(r[name], r[anchor]))
        row.samples = r[name]
        if "+" in name:
            row.decide(row.ratio, "<= 1.1x")
        rows.append(row)
    return rows
