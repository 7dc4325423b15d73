"""Choosing the audit store: ``--audit URL`` / ``MRTR_KEYS_AUDIT``, else a SQLite file in the state directory.

URLs: ``sqlite:///PATH``, ``postgresql://USER@HOST:PORT/DB`` (or ``postgres://``),
``jsonl:///PATH``; ``off`` (or ``none``, ``false``, ``0``) turns auditing off.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import unquote, urlparse

from mrtr_keys.errors import ConfigError, refuse_nul
from mrtr_keys.urls import redact

if TYPE_CHECKING:  # every CLI command imports this module: keep it light
    from mrtr_keys.audit.writing.stores.base import AuditStore
    from mrtr_keys.keystores import Keystore

ENV_AUDIT = "MRTR_KEYS_AUDIT"
OFF_VALUES = frozenset({"off", "none", "false", "0", "no"})
DEFAULT_FILE = "audit.db"


def default_url(directory: str | os.PathLike[str]) -> str:
    """The default store: ``sqlite:///DIRECTORY/audit.db`` (the key ring's directory)."""
    return "sqlite:///" + str(Path(directory).expanduser().absolute() / DEFAULT_FILE).lstrip("/")


def resolve_url(audit: str | Literal[False] | None, directory: str | os.PathLike[str] | None) -> str | None:
    """The store URL to use, or None for off.

    `audit` False or an off word: off. A URL: that. None: ``MRTR_KEYS_AUDIT`` if set, else the
    default beside `directory` (None if there is no directory).
    """
    if audit is False:
        return None
    value = audit if audit is not None else os.environ.get(ENV_AUDIT) or None
    if value is not None:
        value = value.strip()
        if value.lower() in OFF_VALUES:
            return None
        if value:
            refuse_nul(value, "an audit store URL")
            return value
    return default_url(directory) if directory is not None else None


def store_url(audit: str | Literal[False] | None, keystore: Keystore) -> str | None:
    """The audit store URL for the ring in `keystore`: `audit`, else ``MRTR_KEYS_AUDIT``, else
    ``audit.db`` beside the ring (`resolve_url`); None when auditing is off."""
    return resolve_url(audit, keystore.directory)


def existing_store(keystore: Keystore, *, audit: str | Literal[False] | None = None) -> AuditStore | None:
    """The audit store of the ring in `keystore` (as `store_url` picks it), or None when auditing is
    off or the default SQLite file was never written (nothing recorded yet: nothing to read).

    Raises:
        ConfigError: a bad store URL; AuditError: the store cannot be opened.
    """
    url = store_url(audit, keystore)
    if url is None:
        return None
    if url.startswith("sqlite:"):
        from mrtr_keys.audit.writing.stores.sqlite import path_from_url

        if not path_from_url(url).exists():
            return None
    return open_store(url)


def open_store(url: str) -> AuditStore:
    """Open (creating and migrating its schema) the store at `url`.

    Raises:
        ConfigError: unknown scheme or bad URL; AuditError: the store cannot be opened.
    """
    refuse_nul(url, "an audit store URL")
    scheme = url.partition(":")[0].lower()
    if scheme == "sqlite":
        from mrtr_keys.audit.writing.stores.sqlite import SQLiteStore, path_from_url

        return SQLiteStore(path_from_url(url))
    if scheme in ("postgresql", "postgres"):
        from mrtr_keys.audit.writing.stores.postgres import PostgresStore

        return PostgresStore(url)
    if scheme == "jsonl":
        from mrtr_keys.audit.writing.stores.jsonl import JSONLStore

        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise ConfigError("a jsonl audit URL names a local file: jsonl:///PATH")
        return JSONLStore(unquote(parsed.path))
    if "://" not in url and url.endswith((".jsonl", ".db", ".sqlite")):
        raise ConfigError(f"audit store {url!r}: write it as a URL, e.g. sqlite:///{url} or jsonl:///{url}")
    raise ConfigError(f"unknown audit store {redact(url)!r} (sqlite:///PATH, postgresql://..., jsonl:///PATH, or off)")
