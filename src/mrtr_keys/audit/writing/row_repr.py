"""`rows_repr(rows) == repr(rows)` for a batch of store rows, built with fewer `repr` calls.

A batch's chain link (`mrtr_keys.audit.writing.chain.batch_hash`) is SHA-256 over ``repr`` of its rows,
so this text must be byte for byte what `repr` gives: it is `repr`'s own output for the values
that vary from row to row, reused for the ones a batch repeats (instance, client, audience,
kid, op, outcome, reason, writer and the empty chain fields: `repr` of equal strings is equal).
Anything outside the shape it knows takes `repr` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

ROW_FIELDS = 15
"""Fields of a store row: `mrtr_keys.audit.events.FIELDS`, then writer, seq, prev_hash, hash."""

_CACHEABLE = (str, type(None))


def rows_repr(rows: Sequence[tuple[object, ...]]) -> str:
    """``repr(list(rows))`` (a string; equal for every input of built-in types).

    The row-by-row path is taken when every row is a tuple of `ROW_FIELDS` values and every time
    (field 0) is a string that `repr` only wraps in single quotes (printable, without ``'`` or a
    backslash); otherwise the result is `repr` of the list. The repeated fields' text is reused
    only for values that are exactly `str` or None, whose equal values have equal `repr`.
    """
    if not isinstance(rows, list):
        rows = list(rows)
    if set(map(type, rows)) - {tuple} or set(map(len, rows)) - {ROW_FIELDS} or not _quoted_as_is([r[0] for r in rows]):
        return repr(rows)
    known: dict[tuple[object, ...], tuple[str, str, str]] = {}
    get = known.get
    parts: list[str] = []
    append = parts.append
    for time, inst, client, aud, kid, op, outcome, reason, fp, gen, dur, writer, seq, prev, link in rows:
        key = (inst, client, aud, kid, op, outcome, reason, writer, prev, link)
        text = get(key)
        if text is None:
            text = (", ".join(map(repr, key[:7])), f", {writer!r}, ", f", {prev!r}, {link!r})")
            if all(type(v) in _CACHEABLE for v in key):
                known[key] = text
        append(f"('{time}', {text[0]}, {fp!r}, {gen!r}, {dur!r}{text[1]}{seq!r}{text[2]}")
    return "[" + ", ".join(parts) + "]"


def _quoted_as_is(values: list[object]) -> bool:
    """True if `repr` of each value is the value between single quotes (all `str`, printable,
    no ``'``, no backslash: `repr` then neither escapes a character nor switches quotes)."""
    if set(map(type, values)) - {str}:
        return False
    text = "".join(values)  # type: ignore[arg-type]  # all str, checked above
    return "'" not in text and "\\" not in text and text.isprintable()
