"""Where ``audit archive`` puts segments and manifests: a directory, or ``s3://BUCKET/PREFIX``
(`mrtr_keys.audit.retention.archive_s3`).

A destination holds objects by relative name (``segments/RUN/FILE.jsonl.gz``,
``manifests/RUN.json``). Segments are built in a local staging directory first and published only
once the whole run is verified and complete (an object-locked bucket could not take a half run back).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Protocol

from mrtr_keys.errors import AuditError, AuditUnavailable, ConfigError, refuse_nul


class Destination(Protocol):
    """An archive location: objects by relative name (``/``-separated)."""

    @property
    def uri(self) -> str:
        """The location as the user wrote it (a directory path, or ``s3://BUCKET/PREFIX``)."""

    def staging(self) -> Path:
        """A new empty local directory to build files in (removed by `cleanup`)."""

    def cleanup(self, staging: Path) -> None:
        """Remove a directory `staging` returned (whatever is left in it)."""

    def put_file(self, name: str, path: Path) -> None:
        """Publish the local file `path` as `name` (`path` may be moved).

        Raises:
            AuditError: it cannot be written.
        """

    def put_bytes(self, name: str, data: bytes) -> None:
        """Publish `data` as `name`. Raises AuditError."""

    def get(self, name: str, max_bytes: int | None = None) -> bytes | None:
        """The bytes of `name`, or None if there is no such object; with `max_bytes`, at most its
        first ``max_bytes + 1`` (enough to tell that it is longer). Raises AuditError."""

    def list(self, prefix: str) -> list[str]:
        """Names starting with `prefix`, sorted. Raises AuditError."""

    def retention(self) -> str:
        """What keeps published objects from being changed, in words (for the command's output)."""


class DirDestination:
    """A local directory (created if missing). Files are fsynced and renamed into place."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        refuse_nul(str(root), "the archive directory")
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"{self.root}: not a directory")

    @property
    def uri(self) -> str:
        return str(self.root)

    def __repr__(self) -> str:
        return f"DirDestination({str(self.root)!r})"

    def staging(self) -> Path:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))
        except OSError as exc:
            raise AuditUnavailable(f"cannot write the archive directory {self.root}: {exc.strerror}") from None

    def cleanup(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def _target(self, name: str) -> Path:
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def put_file(self, name: str, path: Path) -> None:
        try:
            with path.open("rb+") as f:
                os.fsync(f.fileno())
            target = self._target(name)
            os.replace(path, target)
            _fsync_dir(target.parent)
        except OSError as exc:
            raise AuditUnavailable(f"cannot write {self.root / name}: {exc.strerror}") from None

    def put_files(self, files: list[tuple[str, Path]]) -> None:
        """`put_file` for many files, durable at the same point at less cost: every file fsynced,
        then all renamed, then each directory they went to fsynced once (a run's segments share
        one directory: one directory fsync instead of one a segment, a fixed cost of the run)."""
        current = ""
        try:
            for current, path in files:  # noqa: B007 - named in the error
                with path.open("rb+") as f:
                    os.fsync(f.fileno())
            parents: dict[Path, None] = {}
            for current, path in files:
                target = self._target(current)
                os.replace(path, target)
                parents[target.parent] = None
            for parent in parents:
                current = str(parent.relative_to(self.root))
                _fsync_dir(parent)
        except OSError as exc:  # as `put_file`: an I/O error of the location is an outage (exit 75)
            raise AuditUnavailable(f"cannot write {self.root / current}: {exc.strerror}") from None

    def put_bytes(self, name: str, data: bytes) -> None:
        try:
            target = self._target(name)
            tmp = target.with_name(target.name + ".tmp")
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
            _fsync_dir(target.parent)
        except OSError as exc:
            raise AuditUnavailable(f"cannot write {self.root / name}: {exc.strerror}") from None

    def get(self, name: str, max_bytes: int | None = None) -> bytes | None:
        """Only a regular file is read (a FIFO or device in its place, such as a link to /dev/zero,
        is refused without blocking), and at most ``max_bytes + 1`` of it."""
        path = self.root / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise AuditUnavailable(f"cannot read {path}: {exc.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise AuditError(f"cannot read {path}: not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read() if max_bytes is None else f.read(max_bytes + 1)
        except OSError as exc:
            raise AuditUnavailable(f"cannot read {path}: {exc.strerror}") from None
        finally:
            os.close(fd)

    def list(self, prefix: str) -> list[str]:
        """Every entry under `prefix` but a directory: files, and what is not one (a FIFO, a socket,
        a symbolic link, dangling or to a directory, not followed), which `get` refuses but
        ``verify --from-archive`` still names among the files no manifest lists."""
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_symlink() or not p.is_dir())

    def retention(self) -> str:
        return "a directory: protect it by its owner and permissions, or copy it to locked storage"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_destination(uri: str, *, retain_days: float | None = None, retain_mode: str | None = None) -> Destination:
    """A directory path or ``s3://BUCKET[/PREFIX]``. `retain_days` / `retain_mode`: S3 Object Lock
    retention to set on every object written (see `mrtr_keys.audit.retention.archive_s3.S3Destination`).

    Raises:
        ConfigError: a bad location, or retention asked of a directory.
    """
    if not uri.strip():  # an unset shell variable (--to "$DIR") would have meant the current directory
        raise ConfigError("the archive location is empty: give a directory path or s3://BUCKET/PREFIX")
    if uri.startswith("s3://"):
        from mrtr_keys.audit.retention.archive_s3 import S3Destination

        return S3Destination(uri, retain_days=retain_days, retain_mode=retain_mode)
    if "://" in uri:
        raise ConfigError(f"archive location {uri!r}: use a directory path or s3://BUCKET/PREFIX")
    if retain_days is not None or retain_mode is not None:
        raise ConfigError("--retain-days and --retain-mode apply to an s3:// archive (Object Lock)")
    return DirDestination(uri)
