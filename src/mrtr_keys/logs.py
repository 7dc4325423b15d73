"""Log output for the sidecar and the CLI: ``text`` (default) or ``json`` (one object a line).

``--log-format json`` / ``MRTR_KEYS_LOG_FORMAT=json`` gives lines a log shipper parses without
patterns::

    {"time": "2026-12-01T15:01:36.123Z", "level": "WARNING", "logger": "mrtr_keys.service",
     "message": "...", "pid": 4242}

Messages are the same text in both formats; no secret is ever logged (tokens, secrets and key
material never reach a log call). A traceback is reduced to its exception type (``exc_type``)
in JSON, since exception text may quote input.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from mrtr_keys.errors import ConfigError
from mrtr_keys.urls import scrub

ENV_LOG_FORMAT = "MRTR_KEYS_LOG_FORMAT"
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object a record: time (UTC, ms), level, logger, message, pid (and exc_type)."""

    def format(self, record: logging.LogRecord) -> str:
        ms = int(record.msecs)
        doc: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{ms:03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": scrub(record.getMessage()),
            "pid": record.process,
        }
        if record.exc_info and record.exc_info[0] is not None:
            doc["exc_type"] = record.exc_info[0].__name__
        return json.dumps(doc, ensure_ascii=False)


class ScrubbingFormatter(logging.Formatter):
    """The text format, every line passed through `mrtr_keys.urls.scrub` (no credential in a log line)."""

    def format(self, record: logging.LogRecord) -> str:
        return scrub(super().format(record))


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Our root handler (marked so a second `configure_logging` replaces its formatter, not adds one)."""


def log_format(value: str | None = None) -> str:
    """`value`, else ``MRTR_KEYS_LOG_FORMAT``, else ``text``.

    Raises:
        ConfigError: not ``text`` or ``json``.
    """
    chosen = (value or os.environ.get(ENV_LOG_FORMAT) or "text").strip().lower()
    if chosen not in FORMATS:
        raise ConfigError(f"--log-format must be text or json (got {chosen!r})")
    return chosen


def configure_logging(fmt: str | None = None, *, level: int | None = None, force: bool = False) -> str:
    """Install one stderr handler on the root logger in format `fmt` (see `log_format`).

    Without `level` and `force`, the text format changes nothing (Python's default: warnings and
    errors as bare lines), so plain CLI commands print as they always did. Returns the format in
    use; a caller passes it on to the processes it starts (sidecar workers get it in their settings),
    never through this process's environment.

    Raises:
        ConfigError: an unknown format.
    """
    chosen = log_format(fmt)
    root = logging.getLogger()
    ours = next((h for h in root.handlers if isinstance(h, _Handler)), None)
    if ours is None and chosen == "text" and level is None and not force:
        return chosen
    if ours is None:
        ours = _Handler(sys.stderr)
        root.addHandler(ours)
    ours.setFormatter(JsonFormatter() if chosen == "json" else ScrubbingFormatter(TEXT_FORMAT))
    if level is not None:
        root.setLevel(level)
    elif root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
    return chosen
