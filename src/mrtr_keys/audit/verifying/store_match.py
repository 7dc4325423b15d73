"""Which checkpoint records belong to a store: matched by the store's id, not by how its URL is spelled.

Every SQL audit store carries a random store id (``store_meta``, `mrtr_keys.audit.writing.stores.sql_schema`),
made when the store is created, or on the first open by a mrtr-keys that has store ids. ``audit
checkpoint``, ``prune`` and ``archive`` write it into each checkpoint record as ``store_id``, beside
``store`` (the URL, password removed). A record is this store's when:

- it has a ``store_id``: that id is the store's (the URL is not looked at: a relative and an absolute
  SQLite path, ``localhost`` and ``127.0.0.1``, a URL with or without its password, a file copied or
  restored byte for byte are one store). A record of another id is never applied, whatever its URL;
- it has none (written before store ids, or of a JSON-lines store, which has no id): its ``store`` is
  the store's URL exactly, as before (``verify`` says in one line how many were matched this way).

A checkpoint file is trusted; the store is not: a writer of the store could rewrite its id so that no
checkpoint applies and a truncation goes unseen. So ``audit verify`` reports a break (`id_break`) when

- the file has records of this URL under other ids and none under this store's id (`Matched.replaced`;
  a store recreated at the same place needs a new checkpoint file, or one ``audit checkpoint``);
- or records of another id name a chain (writer) this store holds (`Matched.claimed`): a writer's name
  is unique to the process and store it wrote, so those records were this store's, under the id it had
  (whatever the URL they name it by, and even after a checkpoint under the rewritten id). A copy given
  an id of its own needs its own checkpoint file. ``audit checkpoint`` refuses to record then.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

STORE_ID = "store_id"
"""The checkpoint record field holding the store id."""


@dataclass
class Matched:
    """The checkpoint records of one store (file order) and how they were matched."""

    docs: list[dict[str, Any]] = field(default_factory=list)
    by_id: int = 0
    """Records matched by the store id."""
    by_url: int = 0
    """Records without a store id, matched by the exact URL (written before store ids)."""
    other_ids: list[str] = field(default_factory=list)
    """Ids of other stores that have records under this store's URL (never applied)."""
    own: str | None = None
    """The store's id (None: it has none)."""
    chains: dict[str, str] = field(default_factory=dict)
    """writer -> the other store id whose records (heads, cuts) name that chain (any URL)."""

    @property
    def replaced(self) -> bool:
        """The file knows this URL only under other store ids: the store was replaced, or its id rewritten."""
        return bool(self.other_ids) and self.by_id == 0

    def claimed(self, writers: Iterable[str]) -> list[str]:
        """Other store ids whose records name one of `writers` (chains this store holds), sorted;
        none for a store without an id (a JSON-lines log, such as an ``audit export`` of a store:
        it holds that store's chains and is matched by URL)."""
        if not self.own:
            return []
        return sorted({self.chains[w] for w in writers if w in self.chains})

    def to_json(self, store_id: str | None) -> dict[str, Any]:
        return {
            "store_id": store_id,
            "checkpoints_by_id": self.by_id,
            "checkpoints_by_url": self.by_url,
            "other_store_ids": self.other_ids,
        }


def checkpoints_of(docs: Iterable[dict[str, Any]], store: Any) -> Matched:
    """The records of `docs` that are `store`'s (see the module docstring); `store` has ``url`` and
    ``store_id`` (None for a store without one)."""
    own = getattr(store, "store_id", None)
    url = store.url
    m = Matched(own=own if isinstance(own, str) and own else None)
    for d in docs:
        sid = d.get(STORE_ID)
        if isinstance(sid, str) and sid:
            if sid == own:
                m.docs.append(d)
                m.by_id += 1
            else:
                if d.get("store") == url and sid not in m.other_ids:
                    m.other_ids.append(sid)
                for part in ("heads", "cuts", "carried"):
                    for entry in d.get(part) or []:
                        if isinstance(entry, dict) and "writer" in entry:
                            m.chains.setdefault(str(entry["writer"]), sid)
        elif d.get("store") in (None, url):
            m.docs.append(d)
            m.by_url += 1
    return m


def stamp(doc: dict[str, Any], store: Any) -> dict[str, Any]:
    """`doc` with ``store`` (the URL, password removed) and ``store_id`` (when the store has one)."""
    doc["store"] = store.url
    sid = getattr(store, "store_id", None)
    if sid:
        doc[STORE_ID] = sid
    return doc


def replaced_message(store: Any, m: Matched) -> str:
    """The one line saying why `m.replaced` is a break."""
    ids = ", ".join(m.other_ids)
    return (
        f"the checkpoint file records {store.url} only as store id {ids}, but this store's id is "
        f"{getattr(store, 'store_id', None)}: the store was replaced or its id rewritten, so none of its "
        "checkpoints apply (for a store newly created there, use a new checkpoint file: --checkpoints)"
    )


def id_break(store: Any, m: Matched, writers: Iterable[str]) -> str | None:
    """The one line saying why the store's id does not match its checkpoint file (`writers`: the
    chains the store holds), or None: see the module docstring."""
    writers = list(writers)
    if m.replaced:
        return replaced_message(store, m)
    claimed = m.claimed(writers)
    if not claimed:
        return None
    named = sorted(w for w in writers if m.chains.get(w) in claimed)
    return (
        f"the checkpoint file records {plural_chains(named)} of this store under store id {', '.join(claimed)}, but "
        f"this store's id is {getattr(store, 'store_id', None)}: its id was rewritten (so that those checkpoints "
        "would not apply), or it is a copy given an id of its own, which needs its own checkpoint file"
    )


def plural_chains(writers: list[str]) -> str:
    """``chain W`` / ``3 chains (W, ...)`` for a message."""
    if len(writers) == 1:
        return f"chain {writers[0]}"
    return f"{len(writers)} chains ({', '.join(writers[:3])}{', ...' if len(writers) > 3 else ''})"


def by_url_note(m: Matched, store: Any) -> str | None:
    """The one line about records matched by URL, or None (none, or a store without an id: JSONL)."""
    if not m.by_url or not getattr(store, "store_id", None):
        return None
    n = m.by_url
    return (
        f"note: {n} checkpoint record{'s' if n != 1 else ''} without a store id (written before store ids) "
        "matched by the store URL"
    )
