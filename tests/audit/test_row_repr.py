"""The chain hashes `repr` of a batch's rows: `rows_repr` must give exactly that text for any rows."""

from __future__ import annotations

import math
import os

from hypothesis import given
from hypothesis import strategies as st

from mrtr_keys.audit.capture.items import AuditItem, item_rows
from mrtr_keys.audit.writing.chain import ChainWriter, batch_hash
from mrtr_keys.audit.writing.fingerprint import Fingerprinter
from mrtr_keys.audit.writing.row_repr import ROW_FIELDS, rows_repr

_text = st.text(alphabet=st.characters(codec=None), max_size=12)  # quotes, backslashes, surrogates, controls
_value = st.one_of(
    st.none(),
    _text,
    st.sampled_from(["", "'", '"', "'\"", "\\", "\n", "é", "\ud800", "ok", "1"]),
    st.integers(),
    st.booleans(),
    st.floats(),
    st.sampled_from([0, 0.0, -0.0, 1, 1.0, True, False, math.nan]),
)
_row = st.tuples(*[_value] * ROW_FIELDS)
# Few distinct rows reused many times, so the repeated-field text is reused with equal values of other types.
_rows = st.lists(_row, min_size=1, max_size=4).flatmap(lambda pool: st.lists(st.sampled_from(pool), max_size=30))


@given(_rows)
def test_rows_repr_is_repr_for_any_rows(rows: list[tuple[object, ...]]) -> None:
    assert rows_repr(rows) == repr(rows)


_times = st.one_of(_text, st.sampled_from(["'", "it's", '"', "\\", "a\\b", "\n", "\x00", "\ud800", "é", ""]))
_timed_row = st.tuples(_times, *[_value] * (ROW_FIELDS - 1))


@given(st.lists(_timed_row, max_size=6))
def test_rows_repr_is_repr_whatever_the_times_hold(rows: list[tuple[object, ...]]) -> None:
    assert rows_repr(rows) == repr(rows)


@given(st.lists(st.one_of(_row, st.tuples(_value), st.lists(_value, min_size=ROW_FIELDS, max_size=ROW_FIELDS))))
def test_rows_repr_is_repr_for_rows_of_other_shapes(rows: list[object]) -> None:
    assert rows_repr(rows) == repr(rows)  # type: ignore[arg-type]


def test_equal_values_of_other_types_are_not_given_each_others_text() -> None:
    base = ("2026-01-01T00:00:00.000000Z", "i", "c", "a", "k", "seal", "ok", None, "fp", 1, 0.5, "w", 1, "", "")
    rows = [base, (*base[:2], 1, *base[3:]), (*base[:2], 1.0, *base[3:]), (*base[:2], True, *base[3:]), base]
    rows += [(*base[:9], True, -0.0, *base[11:]), (*base[:9], 1.0, 0.0, *base[11:])]
    assert rows_repr(rows) == repr(rows)


def test_writer_batches_hash_as_repr_of_their_rows() -> None:
    items = [
        AuditItem("seal", "ok", "abcd1234", f"mk1.AAAA{n:04d}", None, 1_780_000_000 + n / 7, "svc", 2, "c'l\\i", 0.25)
        for n in range(500)
    ]
    items.append(AuditItem("ring-loaded", "ok", None, None, None, 1_780_000_100.0, None, None, None, None))
    rows = item_rows(items, "host:1:x", Fingerprinter(os.urandom(32)), {}, "host:1:x:w", 1)
    assert rows_repr(rows) == repr(rows)
    linked = ChainWriter("host:1:x:w").link_rows(rows)
    prev, h = linked[-1][-2:]
    assert isinstance(prev, str) and h == batch_hash(prev, rows)
    import hashlib

    assert h == hashlib.sha256((prev + repr(rows)).encode("utf-8", "surrogatepass")).hexdigest()
