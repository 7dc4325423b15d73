"""SQLite schemas 4 and 5: narrower rows, the same values read back (issue 26, item 5; issue 41).

What a row stores, column by column, and what every reader gets back (exactly the text written, so
the hash chains verify unchanged):

* ``time``: microseconds since the Unix epoch (an INTEGER, at most 8 bytes) when the text is the fixed
  width form `mrtr_keys.audit.events.format_ts` writes (``2026-07-28T10:00:00.123456Z``, years 1970
  to 9999) and reads back identically; any other text is stored as it is. Integers sort before text
  in SQLite, so time windows compare integers with integers.
* ``instance`` and ``writer``: an INTEGER naming a row of ``audit_names (id, name)``: a process's
  names repeat on every row it writes (about 80 bytes a row before).
* ``fingerprint``: the 12 bytes of the 24 lowercase hex characters (a BLOB); other text as it is.

Schema 5 keeps these rows and changes one index (`INDEXES`).

Nothing ``audit query`` shows is lost; ``audit verify`` reads the same values, so a changed name in
``audit_names`` shows as an altered batch. The columns have no declared type (no affinity), so each
value keeps the storage class it was written with.
"""

from __future__ import annotations

import calendar
import re
import time as _time
from collections.abc import Callable, Sequence
from typing import Any

TABLE = """CREATE TABLE audit_events_v4 (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time NOT NULL,
    instance NOT NULL,
    client TEXT,
    audience TEXT,
    kid TEXT,
    op TEXT NOT NULL,
    outcome TEXT NOT NULL,
    reason TEXT,
    fingerprint,
    generation INTEGER,
    duration_ms REAL,
    writer NOT NULL,
    seq INTEGER NOT NULL,
    prev_hash TEXT NOT NULL,
    hash TEXT NOT NULL
)"""
NAMES = "CREATE TABLE IF NOT EXISTS audit_names (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE)"
BUCKET_BITS = 12
"""``--token`` finds its rows through ``(id >> BUCKET_BITS, first 4 bytes of the fingerprint)``: one index probe a
bucket of 4,096 storage positions (about 1,200 at 5 M events), while an insert touches only the newest bucket."""
INDEXES = (
    "CREATE INDEX audit_events_time ON audit_events (time)",
    "CREATE INDEX audit_events_kid_op_time ON audit_events (kid, op, time)",
    "CREATE INDEX audit_events_kid ON audit_events (kid)",
    f"CREATE INDEX audit_events_fpb ON audit_events (id >> {BUCKET_BITS}, substr(fingerprint, 1, 4))",
)
"""Schema 5. ``(kid, op, time)`` serves the rotation gates (a kid's seals in a window) and ``--kid --op``; ``(kid)``
(that is, kid then storage position) serves ``--kid`` alone in storage order, newest first with ``--limit`` at the
cost of N rows however common the kid; ``query --token`` probes ``audit_events_fpb`` once a bucket (then compares
the full value). Schema 4's ``audit_events_fp4`` on the fingerprint's first 4 bytes alone was the same lookup, but
its random keys made every transaction of 2,000 events rewrite most of that index's pages (measured on 100,000 rows:
2.8 of the 7.2 µs an insert took with every index; docs/audit.md)."""
V4_FINGERPRINT_INDEX = "audit_events_fp4"
TO_V5 = (f"DROP INDEX IF EXISTS {V4_FINGERPRINT_INDEX}", INDEXES[3])
"""Schema 4 -> 5 (the rows stay as they are)."""
FINGERPRINT_PREFIX = "substr(fingerprint, 1, 4)"


def fingerprint_clause(version: int) -> str:
    """The clause finding a fingerprint's rows through the index of schema `version` (4 or 5), with two
    placeholders: its first 4 bytes and the full value. ``+`` keeps SQLite from substituting the value into
    the indexed expression (constant propagation), which hides the index."""
    probe = f"{FINGERPRINT_PREFIX} = ? AND +fingerprint = ?"
    if version < 5:
        return probe
    first, last = (f"(SELECT {f}(id) FROM audit_events) >> {BUCKET_BITS}" for f in ("MIN", "MAX"))  # noqa: S608
    buckets = f"WITH RECURSIVE b(n) AS (SELECT {first} UNION ALL SELECT n + 1 FROM b WHERE n < {last}) SELECT n FROM b"  # noqa: S608
    return f"(id >> {BUCKET_BITS}) IN ({buckets}) AND {probe}"


_CANONICAL = re.compile(r"(\d{4}-\d{2}-\d{2}T\d{2}:)(\d{2}):(\d{2})\.(\d{6})Z", re.ASCII)
_HEX24 = re.compile(r"[0-9a-f]{24}")
_MM_SS = [f"{m:02d}:{s:02d}" for m in range(60) for s in range(60)]
"""``MM:SS`` of each second of an hour (decoding a time is then two lookups and one format)."""
_MM_SS_INDEX = {text: i for i, text in enumerate(_MM_SS)}


class Codec:
    """Encodes rows for the narrow table and decodes them back; caches seconds and names."""

    def __init__(self) -> None:
        self._seconds: dict[int, str] = {}
        self._hours: dict[int, str] = {}
        self._hour_starts: dict[str, int] = {}
        self._second_starts: dict[str, int] = {}
        self.ids: dict[str, int] = {}
        self.names: dict[int, str] = {}

    def _second_text(self, sec: int) -> str:
        text = self._seconds.get(sec)
        if text is None:
            if len(self._seconds) > 4_096:
                self._seconds.clear()
            text = _time.strftime("%Y-%m-%dT%H:%M:%S", _time.gmtime(sec))
            self._seconds[sec] = text
        return text

    def _hour_text(self, hour: int) -> str:
        """``YYYY-MM-DDTHH:`` of an hour since the epoch (cached)."""
        if len(self._hours) > 4_096:
            self._hours.clear()
        text = self._hours[hour] = _time.strftime("%Y-%m-%dT%H:", _time.gmtime(hour * 3_600))
        return text

    def encode_time(self, text: object) -> object:
        """Microseconds (int) for a canonical time that reads back identically, else the value."""
        if text.__class__ is not str:
            return text
        m = _CANONICAL.fullmatch(text)  # type: ignore[arg-type]
        if m is None:
            return text
        base = self._hour_starts.get(m[1])
        if base is None:
            base = self._hour_start(m[1])
        minute, second = int(m[2]), int(m[3])
        if base < 0 or minute > 59 or second > 59:  # 2026-02-30, 24:00, leap seconds: kept as text
            return text
        return (base + minute * 60 + second) * 1_000_000 + int(m[4])

    def _hour_start(self, prefix: str) -> int:
        """Unix seconds of ``YYYY-MM-DDTHH:`` if that is a real hour of 1970..9999 that prints back
        the same, else -1 (cached)."""
        start = -1
        try:
            y, mo, d, h = int(prefix[0:4]), int(prefix[5:7]), int(prefix[8:10]), int(prefix[11:13])
            if 1970 <= y:
                candidate = calendar.timegm((y, mo, d, h, 0, 0, 0, 0, 0))
                if self._hour_text(candidate // 3_600) == prefix:
                    start = candidate
        except (ValueError, OverflowError):
            pass
        if len(self._hour_starts) > 4_096:
            self._hour_starts.clear()
        self._hour_starts[prefix] = start
        return start

    def decode_time(self, value: object) -> object:
        if not isinstance(value, int):
            return value
        sec, micro = divmod(value, 1_000_000)
        return f"{self._second_text(sec)}.{micro:06d}Z"

    @staticmethod
    def encode_fingerprint(value: object) -> object:
        if isinstance(value, str) and _HEX24.fullmatch(value):
            return bytes.fromhex(value)
        return value

    @staticmethod
    def decode_fingerprint(value: object) -> object:
        return value.hex() if isinstance(value, bytes) else value

    def name(self, ident: object, reload: Callable[[], dict[int, str]]) -> object:
        """The name of id `ident` (reloading the table once on a miss; an unknown id reads back
        as ``?ID``, which no hash matches: verify reports the batch altered)."""
        if not isinstance(ident, int):
            return ident
        found = self.names.get(ident)
        if found is None:
            self.learn(reload())
            found = self.names.get(ident, f"?{ident}")
        return found

    def learn(self, names: dict[int, str]) -> None:
        self.names.update(names)
        self.ids.update({n: i for i, n in names.items()})

    def _second_start(self, prefix: str) -> int:
        """Microseconds of ``YYYY-MM-DDTHH:MM:SS.`` if that is a real second that prints back the same,
        else -1 (cached)."""
        if len(self._second_starts) > 4_096:
            self._second_starts.clear()
        hour = self._hour_starts.get(prefix[:14])
        if hour is None:
            hour = self._hour_start(prefix[:14])
        mm_ss = _MM_SS_INDEX.get(prefix[14:19])
        ok = hour >= 0 and mm_ss is not None and prefix[19:] == "."
        start = self._second_starts[prefix] = (hour + mm_ss) * 1_000_000 if ok else -1  # type: ignore[operator]
        return start

    def encode_rows(self, rows: Sequence[Sequence[Any]], name_id: Callable[[str], int]) -> list[tuple[Any, ...]]:
        """Rows in `SQL_COLUMNS` order -> narrow rows (`name_id` gives, or makes, a name's id). The writer's hot
        path: a canonical time costs one cached lookup of its second and one ``int`` of its microseconds."""
        ids, seconds, second_start, encode_time = self.ids, self._second_starts, self._second_start, self.encode_time
        out: list[tuple[Any, ...]] = []
        append = out.append
        for t, inst, client, aud, kid, op, outcome, reason, fp, gen, dur, w, seq, prev, h in rows:
            if t.__class__ is str and len(t) == 27 and t[26] == "Z":
                start = seconds.get(t[:20])
                if start is None:
                    start = second_start(t[:20])
                micros = t[20:26]
                if start >= 0 and micros.isdigit() and micros.isascii():
                    t = start + int(micros)
            else:
                t = encode_time(t)
            if fp.__class__ is str and len(fp) == 24:
                try:
                    raw = bytes.fromhex(fp)
                except ValueError:
                    pass
                else:
                    if len(raw) == 12 and raw.hex() == fp:
                        fp = raw
            i = ids.get(inst)
            j = ids.get(w)
            append(
                (
                    t,
                    name_id(inst) if i is None else i,
                    client,
                    aud,
                    kid,
                    op,
                    outcome,
                    reason,
                    fp,
                    gen,
                    dur,
                    name_id(w) if j is None else j,
                    seq,
                    prev,
                    h,
                )
            )
        return out

    def decode_rows(self, rows: Sequence[Sequence[Any]], reload: Callable[[], dict[int, str]]) -> list[tuple[Any, ...]]:
        """Raw rows (position, then narrow `SQL_COLUMNS` values) -> the values as written (the hot
        loop of ``verify``: one tuple built a row, the text of each second made once)."""
        names = self.names
        hours = self._hours
        hour_text = self._hour_text
        out: list[tuple[Any, ...]] = []
        append = out.append
        for pos, t, inst, client, aud, kid, op, outcome, reason, fp, gen, dur, writer, seq, prev, h in rows:
            if t.__class__ is int:
                sec = t // 1_000_000
                hour = sec // 3_600
                prefix = hours.get(hour) or hour_text(hour)
                t = f"{prefix}{_MM_SS[sec - hour * 3_600]}.{t - sec * 1_000_000:06d}Z"
            i = names.get(inst)
            w = names.get(writer)
            append(
                (
                    pos,
                    t,
                    self.name(inst, reload) if i is None else i,
                    client,
                    aud,
                    kid,
                    op,
                    outcome,
                    reason,
                    fp.hex() if fp.__class__ is bytes else fp,
                    gen,
                    dur,
                    self.name(writer, reload) if w is None else w,
                    seq,
                    prev,
                    h,
                )
            )
        return out


Run = tuple[Any, Any, Any, Any, Any, int, bool, str]
"""(first position, last position, writer id, first seq, last seq + 1, rows, whether the last row
carries a link, text): `Pieces.runs`."""
_LAST_TIME = 253_402_300_800_000_000
"""Microseconds of 10000-01-01: canonical times decode below it."""
_CACHEABLE = (str, type(None))


class Pieces:
    """``verify``'s hot loop on narrow rows: the text its chain hash reads, without decoding.

    `runs` turns a page of raw rows into the exact text `mrtr_keys.audit.verifying.verify_stream.Walker`
    hashes (``repr`` of each row as the walk would build it), one format with cached texts for the
    common shape (integer time of 1970..9999, known name ids, a BLOB fingerprint, empty chain
    fields); any other row is decoded and ``repr``-ed."""

    def __init__(
        self,
        codec: Codec,
        reload: Callable[[], dict[int, str]],
        rows: Callable[[int, int], list[tuple[Any, ...]]],
    ) -> None:
        self.codec = codec
        self.reload = reload
        self.rows = rows
        """``rows(lo, hi)``: the store's decoded rows at positions `lo` to `hi`, in order."""
        self._names: dict[int, str] = {}  # id -> repr(name), only for names known
        self._mids: dict[tuple[Any, ...], str] = {}  # (client .. reason) -> their reprs, joined

    def decode(self, row: Sequence[Any]) -> tuple[Any, ...]:
        return self.codec.decode_rows([row], self.reload)[0]

    def name(self, ident: object) -> object:
        return self.codec.name(ident, self.reload)

    def _slow(self, row: Sequence[Any]) -> str:
        """Decode and ``repr`` (learning the names and middle fields the fast format reuses)."""
        d = self.decode(row)
        for ident in (row[2], row[12]):
            if ident.__class__ is int and ident in self.codec.names:
                self._names[ident] = repr(self.codec.names[ident])
        mid = tuple(row[3:9])
        if all(v.__class__ in _CACHEABLE for v in mid):
            if len(self._mids) > 4_096:
                self._mids.clear()
            self._mids[mid] = ", ".join(map(repr, mid))
        return repr((*d[1:14], "", "") if d[15] else d[1:])

    def runs(self, rows: Sequence[Sequence[Any]]) -> list[Run]:
        """The page `rows` (raw rows, position, then narrow `SQL_COLUMNS`, in storage order) as
        `Run` s: each maximal stretch of rows of one chain (an integer name id) with consecutive
        integer seqs, of which only the last may carry a batch's link. Its text is its rows' hash
        pieces (``repr(decoded[1:14] + ("", ""))`` for a row carrying a link, else
        ``repr(decoded[1:])``, decoded as `Codec.decode_rows` would) joined by ``", "``, so the
        batch's hash input is ``"[" + ", ".join(texts of its runs) + "]"``. A row with another
        writer or seq type is a run by itself with writer None (the walk decodes it)."""
        names, mids, mm_ss = self._names, self._mids, _MM_SS
        hours, hour_text = self.codec._hours, self.codec._hour_text
        out: list[Run] = []
        texts: list[str] = []
        lo = hi = w0 = s0 = nxt = None
        for row in rows:
            pos, t, inst, client, aud, kid, op, outcome, reason, fp, gen, dur, w, seq, prev, link = row
            piece = None
            if (
                t.__class__ is int
                and fp.__class__ is bytes
                and 0 <= t < _LAST_TIME
                and (link or (prev == "" and link == ""))
            ):
                ir, wr, mid = names.get(inst), names.get(w), mids.get((client, aud, kid, op, outcome, reason))
                if ir is not None and wr is not None and mid is not None and (inst.__class__ is w.__class__ is int):
                    sec = t // 1_000_000
                    hour = sec // 3_600
                    piece = (
                        f"('{hours.get(hour) or hour_text(hour)}{mm_ss[sec - hour * 3_600]}."
                        f"{t - sec * 1_000_000:06d}Z', {ir}, {mid}, '{fp.hex()}', "
                        f"{gen!r}, {dur!r}, {wr}, {seq!r}, '', '')"
                    )
            if piece is None:
                piece = self._slow(row)
            if texts and w == w0 and seq == nxt and w.__class__ is int and seq.__class__ is int:
                texts.append(piece)
                hi, nxt = pos, seq + 1
            else:
                if texts:
                    out.append((lo, hi, w0, s0, nxt, len(texts), False, ", ".join(texts)))
                texts = [piece]
                lo = hi = pos
                if w.__class__ is int and seq.__class__ is int:
                    w0, s0, nxt = w, seq, seq + 1
                else:
                    w0 = s0 = nxt = None
            if link or nxt is None:
                out.append((lo, hi, w0, s0, nxt, len(texts), bool(link), ", ".join(texts)))
                texts = []
        if texts:
            out.append((lo, hi, w0, s0, nxt, len(texts), False, ", ".join(texts)))
        return out
