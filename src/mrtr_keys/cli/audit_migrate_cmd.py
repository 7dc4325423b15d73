"""`mrtr-keys audit migrate`: bring an audit store to the current schema (5), once (docs/audit.md).

PostgreSQL: the events table becomes narrow rows partitioned by day (every row copied with its storage
position, in one transaction); SQLite from 4: one index replaced, from 3: every row copied into the narrow
rows. Then the events written before the hourly totals of ``audit stats`` existed are counted into them, in
pages (`mrtr_keys.audit.writing.stores.hours`); on a schema 5 store that is all it does. Refuses a store with
nothing left to do.
"""

from __future__ import annotations

import time
from typing import Any

from mrtr_keys.audit.events import plural
from mrtr_keys.audit.writing.stores.base import SCHEMA_VERSION
from mrtr_keys.cli.audit_cmd import _open
from mrtr_keys.cli.audit_options import AuditOpt
from mrtr_keys.cli.options import JsonOpt, KeystoreOpt
from mrtr_keys.errors import ConfigError


def migrate(keystore_: KeystoreOpt = None, audit: AuditOpt = None, json_: JsonOpt = False) -> None:
    """Migrate the audit store from schema 3 or 4 to 5 (PostgreSQL: narrow rows in day partitions, every
    row copied; SQLite: narrow rows and one new index), keeping every event, and count older events into
    the hourly totals of `audit stats`; runs once (stop the writers first on a large store)."""
    from mrtr_keys.cli.output import print_json, print_line

    store = _open(audit, keystore_)
    try:
        run = getattr(store, "migrate", None)
        if run is None:
            raise ConfigError(f"{store.url}: a JSON-lines audit log has no schema to migrate")
        started = time.monotonic()
        sql: Any = store  # a SQL store (it has `migrate`)
        if sql.version >= SCHEMA_VERSION and sql.totals_pending():
            old = new = sql.version
            events = sql.count()
        else:
            old, new, events = run()
        counted = sql.backfill()
        seconds = time.monotonic() - started
    finally:
        store.close()
    if json_:
        print_json(
            {
                "store": store.url,
                "store_id": getattr(store, "store_id", None),
                "from": old,
                "to": new,
                "events": events,
                "counted": counted,
                "seconds": round(seconds, 3),
            }
        )
    elif old == new:
        print_line(f"counted {plural(counted, 'event')} of {store.url} into the hourly totals, in {seconds:.1f} s")
    else:
        print_line(
            f"migrated {store.url} from schema {old} to {new}: {plural(events, 'event')} kept, "
            f"{counted} counted into the hourly totals, in {seconds:.1f} s"
        )
