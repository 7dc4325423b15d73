"""What the exported lock files pin (requirements/*.txt, made by `make lock` from uv.lock)."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def locked_pins(path: Path) -> dict[str, str]:
    """name -> version of every requirement of an exported file whose marker holds on this interpreter."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if not line or line[0] in " #":
            continue
        req = Requirement(line.rstrip(" \\"))
        if req.marker is None or req.marker.evaluate():
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = spec.version
    return pins
