"""What the audit log says about a pending TTL lowering (`mrtr_keys.changes.lifecycle.set_ttl`).

An MCP server takes its ``RequestStateSecurity(ttl=...)`` once, at start, so an instance that
was running before a lowering was requested may still seal tokens under the old, longer TTL.
The lowering may take effect only once the old TTL has passed since the last such seal.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from mrtr_keys.audit.events import format_dt, parse_event_time
from mrtr_keys.audit.writing.stores.base import AuditStore, Query


def last_seal_by_earlier_instances(store: AuditStore, requested_at: datetime, old_ttl: float) -> datetime | None:
    """The time of the newest ``seal`` since `requested_at` by an instance that wrote any event in
    the old TTL (seconds) before `requested_at`; None if there is none.

    Raises:
        AuditError: the store cannot be read.
    """
    before = Query(since=format_dt(requested_at - timedelta(seconds=old_ttl)), until=format_dt(requested_at))
    earlier = {name for name, _ in store.stats("instance", before) if name}
    newest: datetime | None = None
    for name in earlier:
        rows = store.query(Query(op="seal", instance=name, since=format_dt(requested_at), newest_first=True, limit=1))
        if rows:
            t = parse_event_time(rows[0].event.time)
            newest = t if newest is None or t > newest else newest
    return newest
