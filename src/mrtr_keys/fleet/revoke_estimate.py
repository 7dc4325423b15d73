"""What revoking a key will break, from the audit log: the rounds sealed under it and not yet opened.

A round of the MCP protocol's multi-round flow (``InputRequiredResult`` -> retry) carries a token sealed
under the primary; once the key is revoked every instance refuses that token, so the round fails and its
client has to start over. The audit log knows those rounds: every ``seal ok`` event of the kid within the
ring's TTL (an older token has expired anyway) whose fingerprint (`mrtr_keys.audit.writing.fingerprint`: the
same for the seal and every unseal of one token) has no ``unseal ok`` event yet. ``mrtr-keys keys revoke``
prints their number, by audience and instance, before it writes (`estimate`).

It is an estimate: a round whose client never comes back counts; a token sealed by an instance that has
not yet loaded the revocation (seconds, the check interval) does not; and events still queued in an
instance's audit writer (typically well under a second) are not seen yet.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from mrtr_keys.audit.events import OK, format_dt
from mrtr_keys.audit.writing.stores.base import AuditStore, Query
from mrtr_keys.fleet.instances import read_instances
from mrtr_keys.ring.model import KeyRing


@dataclass(frozen=True)
class Estimate:
    """The rounds a revocation of `kid` breaks (`rounds`), by (audience, instance) in `by`, counted from the
    seals since `since` (event time text). `store` is the audit store's URL (password removed), or None
    when the ring has no audit log (then nothing is known and `rounds` is None)."""

    kid: str
    since: str | None
    store: str | None
    rounds: int | None
    by: list[tuple[str | None, str, int]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "kid": self.kid,
            "rounds": self.rounds,
            "since": self.since,
            "audit_store": self.store,
            "by": [{"audience": a, "instance": i, "rounds": n} for a, i, n in self.by],
        }

    def lines(self, ttl: float) -> list[str]:
        """The estimate in sentences, for people (the first one says it all)."""
        if self.rounds is None:
            return [f"no audit log for this key ring: the rounds that revoking {self.kid} breaks cannot be estimated"]
        head = (
            f"revoking {self.kid} breaks {self.rounds} round(s) sealed under it in the last {ttl:g} s and not yet "
            f"opened (audit log {self.store})"
        )
        return [head, *(f"  audience {a or '-'}, instance {i}: {n}" for a, i, n in self.by)]


def estimate(store: AuditStore | None, ring: KeyRing, kid: str, now: datetime) -> Estimate:
    """The rounds sealed under `kid` within `ring`'s TTL before `now` and not yet opened (see the module
    docstring). Instances are shown by their presence name where the presence rows know the process,
    else as the audit event's ``host:pid:start``.

    Raises:
        AuditError: the store cannot be read.
    """
    if store is None:
        return Estimate(kid, None, None, None)
    since = format_dt(now - timedelta(seconds=ring.ttl_seconds))
    sealed: dict[str, tuple[str | None, str]] = {}
    for r in store.iter_query(Query(op="seal", kid=kid, outcome=OK, since=since)):
        if r.event.fingerprint:
            sealed[r.event.fingerprint] = (r.event.audience, r.event.instance)
    if sealed:
        for r in store.iter_query(Query(op="unseal", kid=kid, outcome=OK, since=since)):
            sealed.pop(r.event.fingerprint or "", None)
    names = _names(store)
    counts = Counter((audience, names.get(_process(instance), instance)) for audience, instance in sealed.values())
    by = sorted(((a, i, n) for (a, i), n in counts.items()), key=lambda t: (-t[2], t[0] or "", t[1]))
    return Estimate(kid, since, store.url, len(sealed), by)


def _process(instance: str) -> str:
    """``host:pid`` of an audit event's ``host:pid:start`` instance id."""
    return instance.rsplit(":", 1)[0]


def _names(store: AuditStore) -> dict[str, str]:
    """``host:pid`` -> presence name, for the processes the presence table knows (a process reporting under
    several names, one per store or codec, gets them all: ``web-a/web-b``)."""
    names: dict[str, set[str]] = {}
    for r in read_instances(store):
        if r.host and r.pid is not None:
            names.setdefault(f"{r.host}:{r.pid}", set()).add(r.name)
    return {process: "/".join(sorted(n)) for process, n in names.items()}
