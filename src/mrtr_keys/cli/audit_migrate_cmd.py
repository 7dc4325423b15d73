"""`mrtr-keys audit migrate`: bring an audit store to the current schema (4), once (docs/audit.md).

PostgreSQL: the events table becomes partitioned by day (every row copied with its storage
position, in one transaction); SQLite: the indexes of schema 4. Refuses a store already migrated.
"""

from __future__ import annotations

import time

from mrtr_keys.audit.events import plural
from mrtr_keys.cli.audit_cmd import AuditOpt, _open
from mrtr_keys.cli.options import JsonOpt, KeystoreOpt
from mrtr_keys.errors import ConfigError


def migrate(keystore_: KeystoreOpt = None, audit: AuditOpt = None, json_: JsonOpt = False) -> None:
    """Migrate the audit store to schema 4 (PostgreSQL: partitions by day; SQLite: new indexes),
    keeping every event; runs once (stop the writers first on a large store)."""
    from mrtr_keys.cli.output import print_json, print_line

    store = _open(audit, keystore_)
    try:
        run = getattr(store, "migrate", None)
        if run is None:
            raise ConfigError(f"{store.url}: a JSON-lines audit log has no schema to migrate")
        started = time.monotonic()
        old, new, events = run()
        seconds = time.monotonic() - started
    finally:
        store.close()
    if json_:
        print_json({"store": store.url, "from": old, "to": new, "events": events, "seconds": round(seconds, 3)})
    else:
        print_line(
            f"migrated {store.url} from schema {old} to {new}: {plural(events, 'event')} kept, in {seconds:.1f} s"
        )
