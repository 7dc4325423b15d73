"""Audit events as table rows: the columns that fit 80 terminal columns, or every field (``--wide``).

Narrow: time (``MM-DD HH:MM:SS``, UTC), op, kid, audience, result (``ok``, or the reason of a
rejection or an override such as ``expired`` or ``forced``) and client; the instance, fingerprint,
generation and duration are in ``--wide`` and ``--json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mrtr_keys.cli.output import plain

NARROW_HEADERS = ("time (UTC)", "op", "kid", "audience", "result", "client")
_WIDTHS = {"audience": 12, "client": 10, "result": 14}


def _cut(value: object, width: int) -> str:
    text = "-" if value is None else plain(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def result(ev: dict[str, Any]) -> str:
    """``ok``, the rejection reason, or ``ok:REASON`` for an accepted change with a reason (forced)."""
    if ev.get("outcome") == "ok":
        return f"ok:{ev['reason']}" if ev.get("reason") else "ok"
    return str(ev.get("reason") or ev.get("outcome") or "-")


def narrow_row(ev: dict[str, Any]) -> list[str]:
    """One event in the `NARROW_HEADERS` columns."""
    t = plain(ev.get("time") or "")
    return [
        t[5:19].replace("T", " ") or "-",
        plain(ev.get("op") or "-"),
        plain(ev.get("kid") or "-"),
        _cut(ev.get("audience"), _WIDTHS["audience"]),
        _cut(result(ev), _WIDTHS["result"]),
        _cut(ev.get("client"), _WIDTHS["client"]),
    ]


def wide_row(ev: dict[str, Any], fields: Sequence[str]) -> list[str]:
    """Every field, ``-`` for none."""
    return ["-" if ev.get(f) is None else plain(ev[f]) for f in fields]
