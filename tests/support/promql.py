"""Evaluate the alert expressions of deploy/prometheus/alerts.yaml that have the shape
``max by (LABEL, ...) (METRIC{LABEL="VALUE", ...}) OP NUMBER`` against one scrape of ``/metrics``, without
Prometheus or promtool: the tests assert that an alert fires on exactly the metric values it should."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable

from prometheus_client.parser import text_string_to_metric_families

_SHAPE = re.compile(
    r"^\s*max\s+by\s*\((?P<by>[^)]*)\)\s*\(\s*(?P<metric>[a-z_:][a-z0-9_:]*)\s*(?:\{(?P<match>[^}]*)\})?\s*\)\s*"
    r"(?P<op>>=|<=|==|!=|>|<)\s*(?P<value>[0-9.eE+-]+)\s*$"
)
_MATCHER = re.compile(r'\s*([a-z_][a-z0-9_]*)\s*=\s*"([^"]*)"\s*')
_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
}


def firing(expr: str, exposition: str) -> dict[tuple[str, ...], float]:
    """The series for which `expr` holds: (values of the ``by`` labels) -> the aggregated value.

    Raises:
        ValueError: `expr` is not of the supported shape (the test must then evaluate it another way).
    """
    m = _SHAPE.match(expr)
    if m is None:
        raise ValueError(f"unsupported alert expression: {expr!r}")
    by = [b.strip() for b in m["by"].split(",") if b.strip()]
    want: dict[str, str] = {}
    for part in _parts(m["match"] or ""):
        pair = _MATCHER.fullmatch(part)
        if pair is None:
            raise ValueError(f"unsupported label matcher {part!r} in {expr!r}")
        want[pair[1]] = pair[2]
    groups: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name != m["metric"] or any(sample.labels.get(k) != v for k, v in want.items()):
                continue
            key = tuple(sample.labels.get(b, "") for b in by)
            groups[key] = max(groups.get(key, float("-inf")), sample.value)
    test, threshold = _OPS[m["op"]], float(m["value"])
    return {k: v for k, v in groups.items() if test(v, threshold)}


def _parts(match: str) -> Iterable[str]:
    return [p for p in match.split(",") if p.strip()]
