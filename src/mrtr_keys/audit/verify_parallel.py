"""``audit verify`` of a large SQLite (schema 4) log on two cores: reading and rendering in child
processes, the walk in the parent.

The costly part of a walk is per row: reading it (`sqlite3` builds a Python object per value) and
rendering it to the text its batch hash reads (`mrtr_keys.audit.stores.narrow.Pieces.runs`).
Both are independent from page to page, so `WORKERS` forked children each take every
`WORKERS`-th range of `page` storage positions, render it to `narrow.Run` s (a few per page: the
stretches of one chain with consecutive seqs) and send them through a pipe; the parent receives
the pages in storage order and walks them (`mrtr_keys.audit.verify_stream.Walker.feed_runs`,
which hashes every batch and reads a batch's first and last rows itself). The walk, and so every
finding, is the one-process walk's: only who renders the text changes.

Memory stays bounded: a child renders one page and blocks on the pipe until the parent takes it.
Used only where it pays: at least `MIN_ROWS` positions to read, two CPUs, and a parent with no
other thread (`fork` copies only the calling thread). A child opens its own connection (never the
parent's) and leaves by ``os._exit`` (multiprocessing's fork start), so nothing of the parent's
SQLite state is touched.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import threading
from collections.abc import Callable, Iterator
from typing import Any

from mrtr_keys.audit.stores import narrow
from mrtr_keys.audit.stores.base import SQL_COLUMNS
from mrtr_keys.errors import AuditError, AuditUnavailable

WORKERS = 2
MIN_ROWS = 150_000
"""Storage positions below which one process walks alone (forking costs about 20 ms a child)."""
_SELECT = "SELECT id, " + ", ".join(SQL_COLUMNS) + " FROM audit_events WHERE id > ? AND id <= ? ORDER BY id"  # noqa: S608


def run_pages(
    store: Any, after: int, page: int, *, workers: int = WORKERS, min_rows: int = MIN_ROWS
) -> tuple[int, Iterator[list[narrow.Run]]] | None:
    """(last position, pages) of `narrow.Run` s of every record of `store` (a `SQLiteStore` at schema 4) after
    position `after` up to its last position now, rendered by `workers` children; None where
    this does not apply (another store or schema, a small log, one CPU, threads in this process):
    walk with ``store.run_pages`` then. The caller walks what was appended meanwhile
    (``store.run_pages(last, page)``).

    Raises (while iterating):
        AuditUnavailable: a child died (killed, out of memory: exit 75, run again; not a finding
            about the chain), or could not read the store for a reason the store calls an outage;
        AuditError: it could not read the store otherwise (as the one-process walk would say).
    """
    if not hasattr(store, "piece_view") or not store._narrow():
        return None
    if (os.cpu_count() or 1) < 2 or workers < 2 or (threading.active_count() > 1 and min_rows > 0):
        return None  # (min_rows 0: split even beside other threads, for tests of the split walk)
    first, last = store.position_span(after)
    if last - first < min_rows:
        return None
    ranges = [(lo, min(lo + page, last)) for lo in range(first, last, page)]
    return last, _pages(str(store.path), ranges, workers, store._error)


def _pages(
    path: str, ranges: list[tuple[int, int]], workers: int, error: Callable[[BaseException], type[AuditError]]
) -> Iterator[list[narrow.Run]]:
    ctx = multiprocessing.get_context("fork")
    procs, pipes = [], []
    try:
        for k in range(workers):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(path, ranges[k::workers], send), daemon=True)
            proc.start()
            send.close()
            procs.append(proc)
            pipes.append(recv)
        for i in range(len(ranges)):
            try:
                kind, value = pipes[i % workers].recv()
            except (EOFError, OSError):
                ended = "audit verify: a reading process ended early (killed?): run verify again"
                raise AuditUnavailable(ended) from None
            if kind != "runs":
                raise error(Exception(value))(f"cannot read the audit store {path}: {value}")
            yield value
    finally:
        for recv in pipes:
            recv.close()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()


def _child(path: str, ranges: list[tuple[int, int]], out: Any) -> None:
    """Render `ranges` of the store at `path` and send each as ("runs", runs) (or ("error", text)).
    Ctrl-C is the parent's to handle (it stops the children): ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn = sqlite3.connect(path, timeout=10)

        def names() -> dict[int, str]:
            return {int(i): str(n) for i, n in conn.execute("SELECT id, name FROM audit_names")}

        codec = narrow.Codec()
        codec.learn(names())
        view = narrow.Pieces(codec, names, lambda lo, hi: [])
        for lo, hi in ranges:
            rows = conn.execute(_SELECT, (lo, hi)).fetchall()
            out.send(("runs", view.runs(rows)))
            del rows
    except Exception as exc:
        try:
            out.send(("error", str(exc)))
        except OSError:
            pass
    finally:
        out.close()
