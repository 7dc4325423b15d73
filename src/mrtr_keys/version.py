"""The package's version, for modules inside the package (none imports the package root, `mrtr_keys`)."""

from __future__ import annotations

__version__ = "0.2.0"
"""The release, as in pyproject.toml (a test keeps the two equal)."""
