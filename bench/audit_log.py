"""Fill an audit store with genuine events fast: the writer process's own row builder and chain.

Items are what a sidecar queues (seal and unseal of real tokens, a rejected unseal now and then),
turned into rows by `mrtr_keys.audit.capture.items.item_rows` (fingerprints by the real HMAC), linked by
`mrtr_keys.audit.writing.chain.ChainWriter.link_rows` and stored with the store's own `append_rows`, in
transactions of 2 000 events (the writer's `MAX_TX_EVENTS`), on `chains` chains taking turns, with
keyed links (`mrtr_keys.audit.writing.chain_key`) and the store's switch to them recorded, as a writer does.
Only the codec's sealing is skipped (a few dozen real tokens are reused), which is not part of
what is stored. About 150,000 events/s into SQLite on a 2-core machine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

TX = 2_000
DAY = 86_400.0


def tokens(n: int = 32) -> list[str]:
    """`n` real tokens sealed by a fresh local key ring."""
    import tempfile

    from mrtr_keys.changes.create import create_ring
    from mrtr_keys.codecs.local import LocalAESGCMCodec
    from mrtr_keys.keystores.file import FileKeystore

    with tempfile.TemporaryDirectory() as tmp:
        ring = Path(tmp) / "keyring.json"
        create_ring(FileKeystore(ring))
        codec = LocalAESGCMCodec(ring, audience="billing")
        return [codec.seal(os.urandom(200)) for _ in range(n)]


def fill(
    url: str,
    events: int,
    *,
    start: float | None = None,
    span: float = 40 * DAY,
    chains: int = 3,
    tx: int = TX,
    host: str = "bench-host",
    audit_key: bytes | None = None,
    keyed: bool = True,
) -> None:
    """Append `events` genuine events to the store at `url`, their times spread evenly over
    `span` seconds from `start` (default: `span` ago, so the newest are about now), in
    transactions of `tx` events on `chains` new chains named after `host`. Fingerprints and links
    use `audit_key` (default: the file ``MRTR_KEYS_AUDIT_KEY_FILE`` names, else a random key); links
    are keyed unless `keyed` is False (a store as the release before keyed links wrote it)."""
    from mrtr_keys.audit.capture.items import item_rows
    from mrtr_keys.audit.writing import switch
    from mrtr_keys.audit.writing.chain import ChainWriter
    from mrtr_keys.audit.writing.chain_key import ChainKey
    from mrtr_keys.audit.writing.fingerprint import Fingerprinter, load_shared_audit_key, shared_key_file
    from mrtr_keys.audit.writing.stores.url import open_store

    toks = tokens()
    begin = time.time() - span if start is None else start
    step = span / max(events, 1)
    store = open_store(url)
    shared = shared_key_file()
    if audit_key is None:
        audit_key = load_shared_audit_key(shared) if shared else os.urandom(32)
    fingerprinter = Fingerprinter(audit_key)
    key = ChainKey(audit_key, fleet=True) if keyed else None
    if key is not None:
        switch.ensure(store, key)
    writers = [ChainWriter(f"{host}:{100 + n}:20260101T000000.000000Z#1/p0", key) for n in range(chains)]
    cache: dict[str, str] = {}
    try:
        done = 0
        turn = 0
        while done < events:
            n = min(tx, events - done)
            items = []
            for i in range(done, done + n):
                token = toks[i // 2 % len(toks)]
                rejected = i % 97 == 1
                items.append(
                    (
                        "seal" if i % 2 == 0 else "unseal",
                        "rejected" if rejected else "ok",
                        "1a2b3c4d",
                        token,
                        "expired" if rejected else None,
                        begin + i * step,
                        "billing",
                        1,
                        "web",
                        0.05 + (i % 7) / 100,
                    )
                )
            chain = writers[turn % chains]
            turn += 1
            rows = item_rows(items, chain.writer.split("#")[0], fingerprinter, cache, chain.writer, chain.seq + 1)
            store.append_rows(chain.link_rows(rows))
            done += n
    finally:
        store.close()
