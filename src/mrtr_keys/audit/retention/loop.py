"""The retention a sidecar applies by itself (``serve --audit-retention 30d``; off by default).

A daemon thread (never the event loop) runs `mrtr_keys.audit.retention.prune.prune` every `interval` seconds, in a
child process at low priority (`mrtr_keys.audit.retention.child`),
with the cut-off "now minus `keep`", on its own connection to the audit store, recording each cut in
the checkpoint file (``audit-checkpoints.jsonl`` in the state directory, or
``MRTR_KEYS_AUDIT_CHECKPOINTS``) exactly as ``mrtr-keys audit prune`` does, so ``audit verify``
keeps working. Rules:

* **Never inside the gate window**: the cut-off is at most now minus the ring's TTL minus 60 s (the
  rotation gates read that far back, docs/audit.md).
* **A deadline**: the verifying walk of a run stops after `deadline` seconds (the run fails and is
  tried again at the next interval); once the cut is recorded, the deletion (bounded batches, each
  a short transaction) runs to its end, so the log is never left half pruned by the deadline.
* **One pruner per checkpoint file**: an exclusive lock file beside it (another sidecar process on
  the same host skips its run). With several hosts on one PostgreSQL store, enable it on one.
* **It says when it last succeeded** (`status`): ``/readyz`` (``audit_retention``) and ``/metrics``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mrtr_keys.audit.events import format_ts, parse_when, plural
from mrtr_keys.audit.writing.chain_key import ChainKey
from mrtr_keys.errors import ConfigError
from mrtr_keys.urls import redact

log = logging.getLogger("mrtr_keys.audit.retention.loop")

DEFAULT_INTERVAL = 3600.0
"""Seconds between runs."""
DEFAULT_DEADLINE = 600.0
"""Seconds a run's verifying walk may take before the run gives up (tried again next interval)."""
CHILD = "mrtr_keys.audit.retention.child"
"""The module each run executes in (``python -m``)."""
GATE_MARGIN = 60.0
"""Seconds past the ring's TTL the retire gate may look back (docs/audit.md, Rotation gates)."""


_KEEP = re.compile(r"([+-]?\d+(?:\.\d+)?)\s*([smhdw])")


def check_keep(keep: str) -> str:
    """`keep` if it is a positive duration (``90s``, ``15m``, ``12h``, ``30d``, ``4w``).

    Raises:
        ConfigError: it is not a duration, or not a positive one (``-5d``, ``0d``).
    """
    text = keep.strip() if isinstance(keep, str) else ""
    m = _KEEP.fullmatch(text)
    if m is None:
        raise ConfigError("audit_retention must be a duration such as 30d, 12w or 36h (or unset: off)")
    if float(m.group(1)) <= 0:
        raise ConfigError(f"audit_retention must be a positive duration such as 30d, not {text!r}")
    parse_when(text.lstrip("+"))  # raises ConfigError on a duration reaching before year 1
    return text.lstrip("+")


def check_store(url: str | None) -> None:
    """Refuse, before a sidecar starts, a retention whose audit store cannot be pruned: auditing off
    (`url` None) or a JSON-lines log (rotated by its shipper; `mrtr_keys.audit.retention.prune`).

    Raises:
        ConfigError: one line naming the store and what to do.
    """
    if url is None:
        raise ConfigError("audit_retention needs an audit store, but auditing is off (--audit off)")
    if url.partition(":")[0].lower() == "jsonl":
        raise ConfigError(
            f"audit_retention cannot prune {redact(url)}: a JSON-lines audit log is rotated by its log shipper; "
            "use a SQLite or PostgreSQL store, or unset --audit-retention"
        )


class Retention:
    """Prunes `url`'s audit store every `interval` seconds, keeping the last `keep` (a duration).

    Args:
        url: the audit store (SQLite or PostgreSQL; a JSON-lines log cannot be pruned: each run fails
            with that message in `status`).
        keep: how much to keep (``30d``).
        checkpoints: the checkpoint file the cuts go to.
        ttl: callable giving the ring's TTL in seconds now (the gate window).
        chain_keys: the chain keys the prune's walk checks keyed links with (the writers' current one
            first, then retired ones, `mrtr_keys.audit.writing.chain_key`); they reach the run's process through
            its stdin pipe only. Without them a keyed link stops the prune.
    """

    def __init__(
        self,
        url: str,
        keep: str,
        checkpoints: Path,
        ttl: Callable[[], float],
        *,
        interval: float = DEFAULT_INTERVAL,
        deadline: float = DEFAULT_DEADLINE,
        chain_keys: list[ChainKey] | None = None,
    ) -> None:
        self.url, self.keep, self.checkpoints, self._ttl = url, check_keep(keep), Path(checkpoints), ttl
        self._chain_keys = list(chain_keys or ())
        self.interval, self.deadline = interval, deadline
        self.last_success: float | None = None
        self.last_attempt: float | None = None
        self.last_error: str | None = None
        self.last_deleted = 0
        self.deleted_total = 0
        self.runs = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (the first run after one interval)."""
        self._thread = threading.Thread(target=self._loop, name="mrtr-audit-retention", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the thread to stop (a run in progress stops at its next page) and wait up to `timeout` s."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.run_once()

    def cutoff(self, now: float) -> str:
        """Now minus `keep`, but never inside the gate window (now minus TTL minus 60 s)."""
        keep_from = parse_when(self.keep, now=_utc(now))
        gate = format_ts(now - float(self._ttl()) - GATE_MARGIN)
        return min(keep_from, gate)

    def run_once(self) -> bool:
        """One run (what the thread does each interval); True if it succeeded. Never raises.

        The prune runs in a child process at low priority (`mrtr_keys.audit.retention.child`): its
        verifying walk is pure Python, and as a thread it took the interpreter lock from the requests.
        """
        now = time.time()
        self.last_attempt = now
        request = {
            "url": self.url,
            "checkpoints": str(self.checkpoints),
            "before": self.cutoff(now),
            "now": now,
            "deadline": self.deadline,
            "libpq": {k: v for k, v in os.environ.items() if k.startswith("PG")},
            "chain_keys": [k.material().hex() for k in self._chain_keys],
        }
        try:
            result = self._in_child(request)
        except Exception as exc:  # a background loop never dies of one bad run
            return self._failed(f"audit retention: {type(exc).__name__}: {exc}")
        if result.get("skipped"):
            log.info("audit retention: another process is pruning (%s.lock held); skipping this run", self.checkpoints)
            return False
        if not result.get("ok"):
            return self._failed(str(result.get("error") or "audit retention: the run failed"))
        deleted = int(result["deleted"])
        self.runs += 1
        self.last_success = time.time()
        self.last_error = None
        self.last_deleted = deleted
        self.deleted_total += deleted
        if deleted:
            log.info(
                "audit retention: pruned %s before %s in %.1f s",
                plural(deleted, "record"),
                request["before"],
                float(result["seconds"]),
            )
        return True

    def _in_child(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run `request` in `mrtr_keys.audit.retention.child`; SIGTERM it when `stop` is asked."""
        from mrtr_keys.audit.writing.writer.child_writer import child_environment, package_root

        env = child_environment(os.environ)
        env["PYTHONPATH"] = package_root() + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        from mrtr_keys.hardening import child_args

        proc = subprocess.Popen(
            [sys.executable, "-m", CHILD, *child_args()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            env=env,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request).encode())
            proc.stdin.close()
            asked = False
            while proc.poll() is None:
                if self._stop.is_set() and not asked:
                    proc.terminate()  # the walk stops at its next page; a deletion under way finishes
                    asked = True
                try:
                    proc.wait(0.2)
                except subprocess.TimeoutExpired:
                    pass
            out = proc.stdout.read().decode(errors="replace").strip().splitlines()
        finally:
            proc.stdout.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if not out:
            return {"ok": False, "error": f"audit retention: its process ended with status {proc.returncode}"}
        doc: dict[str, Any] = json.loads(out[-1])
        return doc

    def _failed(self, message: str) -> bool:
        if message != self.last_error:
            log.warning("%s", message)
        self.last_error = message
        return False

    def status(self) -> dict[str, Any]:
        """``/readyz``'s ``audit_retention``: the setting and when a run last succeeded (UTC text)."""
        return {
            "keep": self.keep,
            "interval_seconds": self.interval,
            "last_success": None if self.last_success is None else format_ts(self.last_success),
            "last_attempt": None if self.last_attempt is None else format_ts(self.last_attempt),
            "last_deleted": self.last_deleted,
            "error": self.last_error,
        }


def _utc(now: float) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(now, UTC)
