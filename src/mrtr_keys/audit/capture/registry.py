"""The process's audit sinks: one per (store URL, audit key directory), opened on first use."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from mrtr_keys.audit.capture.sink import AuditSink, Mode, close_all
from mrtr_keys.errors import ConfigError

logger = logging.getLogger("mrtr_keys.audit")

ENV_WRITER = "MRTR_KEYS_AUDIT_WRITER"
"""``thread`` or ``process`` (default): the writer `shared_sink` uses."""


def writer_mode() -> Mode:
    """The writer `shared_sink` uses: ``MRTR_KEYS_AUDIT_WRITER`` (``thread``/``process``), else process.

    Raises:
        ConfigError: another value.
    """
    value = (os.environ.get(ENV_WRITER) or "process").strip().lower()
    if value == "process":
        return "process"
    if value == "thread":
        return "thread"

    raise ConfigError(f"{ENV_WRITER} must be 'thread' or 'process', not {value!r}")


_open_sinks: dict[tuple[str, str], AuditSink] = {}
_open_lock = threading.Lock()


def shared_sink(
    url: str, directory: str | os.PathLike[str], *, factory: Callable[[], AuditSink] | None = None
) -> AuditSink:
    """The process's one sink for (`url`, audit key `directory`), opened on first use.

    Raises:
        ConfigError, AuditError: the store URL is bad or the store cannot be opened;
            ConfigError: the audit key is unusable.
    """
    key = (url, str(directory))
    with _open_lock:
        sink = _open_sinks.get(key)
        if sink is None or sink._closed:
            if factory is not None:
                sink = factory()
            else:
                from mrtr_keys.audit.writing.fingerprint import Fingerprinter, load_audit_key
                from mrtr_keys.audit.writing.stores.url import open_store

                fingerprinter = Fingerprinter(load_audit_key(directory))
                sink = AuditSink(
                    open_store(url), fingerprinter, reopen=lambda: open_store(url), mode=writer_mode(), url=url
                )
            _open_sinks[key] = sink
        return sink


def close_shared() -> None:
    """Flush and close every sink of this process and forget the shared ones."""
    close_all()
    _open_sinks.clear()


__all__ = ["close_shared", "shared_sink", "writer_mode"]
