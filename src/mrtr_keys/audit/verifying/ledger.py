"""Where the records ``verify`` trusts are kept: a file, a directory, or ``s3://BUCKET/PREFIX``.

A record is one JSON object: a checkpoint (``audit checkpoint``: every chain's head), a prune record
(``"kind": "prune"``: the cuts, and an archive's manifest), or an anchor (``"kind": "anchor"``: the heads a
running service wrote, `mrtr_keys.audit.verifying.anchor`). What each means is
`mrtr_keys.audit.verifying.trust`'s; here is only where they are and how they are appended and read:

* **a file** (any path that is not an existing directory and does not end in ``/``): JSON Lines, each
  record appended in one ``write`` (``O_APPEND``, so processes appending together do not interleave) and
  fsynced. Make it append-only (``chattr +a``) or another account's.
* **a directory** (an existing one, or a path ending in ``/``): one such file per writer of records,
  ``STEM.jsonl`` (an anchoring process's instance, or ``checkpoints``); read: every ``*.jsonl`` in it.
* **S3** (``s3://BUCKET/PREFIX``): one object per record, ``anchors/STEM/TIME.json`` or
  ``checkpoints/TIME-N.json``, written once; with Object Lock (the bucket's default retention, as for
  archives: `mrtr_keys.audit.retention.archive_s3`) nobody can change or delete one before it expires. Reading
  takes every checkpoint and, of each anchoring instance, its newest anchor only (a verify reads a
  handful of objects, not one per interval the fleet ran).

Errors, as the store's (docs/audit.md, exit codes): a location that cannot be read or written now (an I/O
error, no permission, a file where a directory should be, S3 silent or 5xx) is `AuditUnavailable` (exit
75); a malformed record, or a location that cannot be one (another URL scheme), is `ConfigError` (exit 2).
A file or directory that does not exist yet holds no records (the first append makes it).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, Protocol

from mrtr_keys.errors import AuditUnavailable, ConfigError, refuse_nul

ANCHOR = "anchor"
"""``kind`` of an anchor record."""
PRUNE = "prune"
"""``kind`` of a prune record (``audit prune``, ``audit archive``, the sidecar's retention)."""
ARCHIVE = "archive"
"""Key of the archive reference (``location``, ``manifest``, ``sha256``) in a prune record."""
RECORD_MAX = 1 << 20
"""Bytes one record may have in an object store (a record of a few hundred chains is a few tens of kB)."""
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


class Ledger(Protocol):
    """A place records are appended to and read from (see the module docstring)."""

    @property
    def uri(self) -> str: ...

    def append(self, doc: dict[str, Any], stem: str = "checkpoints") -> None:
        """Append `doc` durably; `stem` names the writer of records (an anchoring instance).

        Raises:
            AuditUnavailable: the location cannot be written now.
        """

    def read(self) -> list[dict[str, Any]]:
        """The records kept here, in the order written (per file or object name).

        Raises:
            AuditUnavailable: the location cannot be read now; ConfigError: a record is malformed.
        """


def stem(name: str) -> str:
    """A file-name-safe form of an instance or writer name (with a short hash: distinct names stay distinct)."""
    import hashlib

    return f"{_SAFE.sub('_', name)[:80]}.{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


def open_ledger(location: str | os.PathLike[str]) -> Ledger:
    """The ledger at `location` (see the module docstring).

    Raises:
        ConfigError: an empty location, or a URL scheme other than ``s3://``.
    """
    text = str(location)
    if not text.strip():
        raise ConfigError("the checkpoint location is empty: give a file, a directory or s3://BUCKET/PREFIX")
    refuse_nul(text, "the checkpoint location")
    if text.startswith("s3://"):
        return S3Ledger(text)
    if "://" in text:
        raise ConfigError(f"checkpoint location {text!r}: use a file, a directory or s3://BUCKET/PREFIX")
    path = Path(text)
    if text.endswith("/") or path.is_dir():
        return DirLedger(path)
    return FileLedger(path)


class FileLedger:
    """One JSON Lines file (the checkpoint file of ``audit checkpoint`` and ``prune``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def uri(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"FileLedger({str(self.path)!r})"

    def append(self, doc: dict[str, Any], stem: str = "checkpoints") -> None:
        line = (json.dumps(doc, separators=(",", ":")) + "\n").encode("utf-8")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise AuditUnavailable(f"cannot append to {self.path}: {exc.strerror}") from None

    def read(self) -> list[dict[str, Any]]:
        return list(read_lines(self.path))


class DirLedger:
    """A directory of JSON Lines files, one per writer of records (``STEM.jsonl``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def uri(self) -> str:
        return str(self.root) + "/"

    def __repr__(self) -> str:
        return f"DirLedger({str(self.root)!r})"

    def append(self, doc: dict[str, Any], stem: str = "checkpoints") -> None:
        FileLedger(self.root / f"{stem}.jsonl").append(doc)

    def read(self) -> list[dict[str, Any]]:
        try:
            files = sorted(p for p in self.root.iterdir() if p.name.endswith(".jsonl"))
        except FileNotFoundError:
            return []  # nothing written there yet (as a checkpoint file that does not exist yet)
        except OSError as exc:  # not a directory (a file in its place), no permission, an I/O error
            raise AuditUnavailable(f"cannot read {self.uri}: {exc.strerror}") from None
        return [doc for f in files for doc in read_lines(f)]


S3_DEADLINES = (2.0, 3.0, 2)
"""(connect, read, attempts) of every S3 call for records (a few hundred bytes each): a destination that
is silent is known within about 10 s (a verify exits 75, an anchor run fails and is tried next interval)."""


class S3Ledger:
    """``s3://BUCKET/PREFIX``: one object per record (see the module docstring)."""

    def __init__(self, uri: str) -> None:
        from mrtr_keys.audit.retention.archive_s3 import S3Destination

        self._dest = S3Destination(uri, deadlines=S3_DEADLINES)
        self._n = 0

    @property
    def uri(self) -> str:
        return self._dest.uri

    def __repr__(self) -> str:
        return f"S3Ledger({self.uri!r})"

    def append(self, doc: dict[str, Any], stem: str = "checkpoints") -> None:
        when = str(doc.get("time", "")).replace(":", "")
        self._n += 1
        if doc.get("kind") == ANCHOR:
            name = f"anchors/{stem}/{when}.json"
        else:
            name = f"checkpoints/{when}-{os.getpid()}-{self._n}.json"
        self._dest.put_bytes(name, json.dumps(doc, separators=(",", ":")).encode("utf-8"))

    def read(self) -> list[dict[str, Any]]:
        names = self._dest.list("checkpoints/")
        newest: dict[str, str] = {}
        for name in self._dest.list("anchors/"):
            folder = name.rsplit("/", 1)[0]
            newest[folder] = max(newest.get(folder, ""), name)
        out = []
        for name in [*names, *sorted(newest.values())]:
            data = self._dest.get(name, RECORD_MAX)
            if data is None:
                continue  # removed since it was listed (an expired, unlocked object)
            if len(data) > RECORD_MAX:
                raise ConfigError(f"{self.uri}/{name}: larger than {RECORD_MAX:,} bytes (not a record mrtr-keys wrote)")
            out.append(parse_record(data.decode("utf-8", "replace"), f"{self.uri}/{name}"))
        return out


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The records of the JSON Lines file `path` (none if it does not exist).

    Raises:
        ConfigError: a line is not a record, or `path` is not a regular file; AuditUnavailable: it
            cannot be read now.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise AuditUnavailable(f"cannot read {path}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device (/dev/zero was read until memory ran out)
            raise ConfigError(f"{path}: not a checkpoint file (not a regular file)")
        with os.fdopen(fd, "r", encoding="utf-8", closefd=False) as f:
            return [parse_record(line, f"{path}:{n}") for n, line in enumerate(f, 1) if line.strip()]
    except OSError as exc:
        raise AuditUnavailable(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a checkpoint file (not UTF-8 text)") from None
    finally:
        os.close(fd)


def parse_record(text: str, where: str) -> dict[str, Any]:
    """One record from its JSON text (`where` names its place in messages).

    Raises:
        ConfigError: not a record.
    """
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise ConfigError(f"{where}: not a checkpoint (bad JSON)") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("heads"), list):
        raise ConfigError(f"{where}: not a checkpoint")
    if not _well_formed(doc):
        raise ConfigError(
            f"{where}: not a checkpoint (a head or cut without a writer, seq and hash, or a store_id not text)"
        )
    return doc


def _well_formed(doc: dict[str, Any]) -> bool:
    """Every head and cut a dict of a text ``writer`` and ``hash`` and a whole ``seq`` >= 0, a
    ``store_id`` text if present (what the walks index by; an edited file crashed them)."""
    for part in ("heads", "cuts", "carried"):
        entries = doc.get(part, [])
        if not isinstance(entries, list):
            return False
        for e in entries:
            if not isinstance(e, dict) or not isinstance(e.get("writer"), str) or not isinstance(e.get("hash"), str):
                return False
            seq = e.get("seq")
            if seq.__class__ is not int or seq < 0:
                return False
    return doc.get("store_id") is None or isinstance(doc.get("store_id"), str)


__all__ = ["ANCHOR", "ARCHIVE", "PRUNE", "DirLedger", "FileLedger", "Ledger", "S3Ledger", "open_ledger", "stem"]
