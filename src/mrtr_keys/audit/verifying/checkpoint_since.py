"""``audit checkpoint`` without rescanning the log: heads carried from the last checkpoint, plus what was added.

A checkpoint document records, besides every chain's head, ``position``: the highest storage position
it read. The next checkpoint of the same store starts from that document's heads and reads only the
records after ``position - OVERLAP`` (`AuditStore.row_batches`: bounded pages), so its cost follows
what was written since, not the size of the log. The overlap covers transactions that were still
being committed when the last checkpoint read the store: PostgreSQL hands out ``id`` values when
rows are inserted, so a transaction can commit after a later one that took higher ids; re-reading
records is harmless (a head is the highest seq seen of a chain).

A chain pruned entirely keeps its last head in the carried set; ``verify`` skips heads at or before a
prune's cut. ``audit checkpoint --full`` reads everything (the first checkpoint always does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mrtr_keys.audit.events import format_ts
from mrtr_keys.audit.verifying.ledger import PRUNE
from mrtr_keys.audit.verifying.store_match import stamp
from mrtr_keys.audit.writing import switch
from mrtr_keys.audit.writing.chain_key import ChainKeys

OVERLAP = 50_000
"""Records before the last checkpoint's position read again (transactions committing out of id order)."""
_TIME, _WRITER, _SEQ, _HASH = 1, 12, 13, 15  # in a raw row: position, then `SQL_COLUMNS`


def last_position(docs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest checkpoint in `docs` (one store's documents, file order) that records a position."""
    found = [d for d in docs if d.get("kind") != PRUNE and isinstance(d.get("position"), int)]
    return found[-1] if found else None


def make_checkpoint_since(
    store: Any, docs: Sequence[dict[str, Any]], *, now: float, full: bool = False, keys: ChainKeys | None = None
) -> dict[str, Any]:
    """A checkpoint document of `store` (``time``, ``store``, ``store_id``, ``heads``, ``position``,
    ``read_from``, and ``chain_switch`` when the store records one): every chain's head, reading only
    the records after the last checkpoint in `docs` that has a position (all of them with `full` or
    when there is none); MACed with the current chain key of `keys` (`mrtr_keys.audit.writing.chain_key`).

    Raises:
        AuditError: the store cannot be read.
    """
    base = None if full else last_position(docs)
    heads: dict[str, dict[str, Any]] = {}
    position = 0
    if base is not None:
        heads = {str(h["writer"]): dict(h) for h in base.get("heads", [])}
        position = int(base["position"])
    after = max(0, position - OVERLAP) if base is not None else 0
    for rows in store.row_batches(after):
        for r in rows:
            writer, seq = str(r[_WRITER]), int(r[_SEQ])
            prev = heads.get(writer)
            if prev is None or seq > int(prev["seq"]):
                heads[writer] = {"writer": writer, "seq": seq, "hash": r[_HASH], "time": r[_TIME]}
        position = max(position, int(rows[-1][0]))
        del rows
    doc = stamp({"time": format_ts(now)}, store)
    doc = {**doc, "heads": list(heads.values()), "position": position, "read_from": after}
    if keys is not None:
        found = switch.read(store, keys)
        if found is not None and found.problem is None:
            doc[switch.NAME] = found.to_json()
        keys.current.sign(doc)
    return doc
