"""The `SQLStore` hooks of narrow rows (`mrtr_keys.audit.writing.stores.narrow`), shared by SQLite (schemas 4 and 5) and
PostgreSQL (schema 5): times as integer microseconds, instance and writer names as ids of ``audit_names``,
fingerprints as 12 bytes, and every value read back exactly as written (issue 41)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mrtr_keys.audit.writing.stores import narrow
from mrtr_keys.audit.writing.stores.base import SCHEMA_VERSION


class NarrowRows:
    """Mixin of a `mrtr_keys.audit.writing.stores.sql.SQLStore` dialect; `_narrow` says whether the open store
    holds narrow rows (its schema version)."""

    PARAM: str
    version: int
    if TYPE_CHECKING:  # supplied by SQLStore (declared here only: a stub would shadow it in the MRO)

        def _fetch(self, sql: str, args: Sequence[Any]) -> list[Any]: ...

        @staticmethod
        def _current_version(cur: Any) -> int: ...

    def _init_narrow(self) -> None:
        self._codec = narrow.Codec()
        self._pending: dict[int, str] = {}

    def _narrow(self) -> bool:
        raise NotImplementedError

    def _name_id(self, cur: Any, name: str, learn: Any) -> int:
        """The id of `name` in ``audit_names``, made if new (inside the caller's transaction); `learn`
        is told the pair."""
        p = self.PARAM
        cur.execute(f"INSERT INTO audit_names (name) VALUES ({p}) ON CONFLICT (name) DO NOTHING", (name,))  # noqa: S608
        cur.execute(f"SELECT id FROM audit_names WHERE name = {p}", (name,))  # noqa: S608
        ident = int(cur.fetchone()[0])
        learn({ident: name})
        return ident

    def _encode_rows(self, cur: Any, rows: Any) -> Any:
        if self.version < SCHEMA_VERSION:  # migrated by `audit migrate` since this process opened it?
            self.version = self._current_version(cur)
        if not self._narrow():
            return rows
        self._pending = {}
        made: dict[str, int] = {}  # names new to this process, once each per transaction

        def name_id(name: str) -> int:
            ident = made.get(name)
            if ident is None:
                ident = made[name] = self._name_id(cur, name, self._pending.update)
            return ident

        return self._codec.encode_rows(rows, name_id)

    def _appended(self) -> None:
        if self._pending:  # names made by a transaction that committed
            self._codec.learn(self._pending)
            self._pending = {}

    def _names(self) -> dict[int, str]:
        return {int(i): str(n) for i, n in self._fetch("SELECT id, name FROM audit_names", [])}

    def _decode(self, rows: list[Any]) -> list[Any]:
        return self._codec.decode_rows(rows, self._names) if self._narrow() else rows

    def _value(self, column: str, value: Any) -> Any:
        if not self._narrow():
            return value
        if column == "time":
            return self._codec.encode_time(value)
        if column == "fingerprint":
            return self._codec.encode_fingerprint(value)
        if column in ("instance", "writer"):
            if value not in self._codec.ids:
                self._codec.learn(self._names())
            return self._codec.ids.get(value, -1)  # a name never written matches nothing
        return value

    def _raw_hours(self) -> tuple[str, str]:
        if not self._narrow():
            return "time", "instance"
        return "time", "(SELECT name FROM audit_names WHERE audit_names.id = audit_events.instance)"

    def _time_text(self, value: Any) -> Any:
        return self._codec.decode_time(value)

    def _stat_key(self, by: str, key: Any) -> Any:
        return self._codec.name(key, self._names) if by == "instance" and self._narrow() else key
