"""``audit verify`` of a large narrow log (SQLite 4 and 5, PostgreSQL 5) on two cores: reading and rendering
in child processes, the walk in the parent.

The costly part of a walk is per row: reading it (`sqlite3` builds a Python object per value) and
rendering it to the text its batch hash reads (`mrtr_keys.audit.writing.stores.narrow.Pieces.runs`).
Both are independent from page to page, so `WORKERS` forked children each take every
`WORKERS`-th range of `page` storage positions, render it to `narrow.Run` s (a few per page: the
stretches of one chain with consecutive seqs) and send them through a pipe; the parent receives
the pages in storage order and walks them (`mrtr_keys.audit.verifying.verify_stream.Walker.feed_runs`,
which hashes every batch and reads a batch's first and last rows itself). The walk, and so every
finding, is the one-process walk's: only who renders the text changes.

Memory stays bounded: a child renders one page and blocks on the pipe until the parent takes it.
Used only where it pays: at least `MIN_ROWS` positions to read, two CPUs, and a parent with no
other thread but the deadline watchdog (`fork` copies only the calling thread; a child never uses the
watchdog). A child opens its own connection (never the parent's: `store.reader()`, whose connection
string stays in the forked memory, never an argument or the environment) and leaves by ``os._exit``
(multiprocessing's fork start), so nothing of the parent's store state is touched. A child that says
nothing for `READ_DEADLINE` seconds (a PostgreSQL server gone silent) ends the walk: `AuditUnavailable`.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from mrtr_keys.audit.writing.stores import narrow
from mrtr_keys.errors import AuditError, AuditUnavailable

WORKERS = 2
MIN_ROWS = 150_000
"""Storage positions below which one process walks alone (forking costs about 20 ms a child)."""
READ_DEADLINE = 30.0
"""Seconds the walk waits for a child's next page (as a store's read deadline)."""
_SAFE_THREADS = frozenset({"mrtr-keys-deadlines"})
"""Threads a fork may leave behind: the children never call into them."""


def run_pages(
    store: Any, after: int, page: int, *, workers: int = WORKERS, min_rows: int = MIN_ROWS
) -> tuple[int, Iterator[list[narrow.Run]]] | None:
    """(last position, pages) of `narrow.Run` s of every record of `store` (SQLite at schema 4 or 5, PostgreSQL
    at 5: its `reader`) after position `after` up to its last position now, rendered by `workers` children;
    None where this does not apply (another store or schema, a small log, one CPU, threads in this process):
    walk with ``store.run_pages`` then. The caller walks what was appended meanwhile
    (``store.run_pages(last, page)``).

    Raises (while iterating):
        AuditUnavailable: a child died (killed, out of memory: exit 75, run again; not a finding
            about the chain), or could not read the store for a reason the store calls an outage;
        AuditError: it could not read the store otherwise (as the one-process walk would say).
    """
    if not hasattr(store, "reader") or not store._narrow():
        return None
    others = [t for t in threading.enumerate() if t is not threading.current_thread() and t.name not in _SAFE_THREADS]
    if (os.cpu_count() or 1) < 2 or workers < 2 or (others and min_rows > 0):
        return None  # (min_rows 0: split even beside other threads, for tests of the split walk)
    first, last = store.position_span(after)
    if last - first < min_rows:
        return None
    ranges = [(lo, min(lo + page, last)) for lo in range(first, last, page)]
    return last, _pages(store.url, store.reader(), ranges, workers, store._error)


def _pages(
    where: str,
    reader: tuple[Callable[[], Any], str],
    ranges: list[tuple[int, int]],
    workers: int,
    error: Callable[[BaseException], type[AuditError]],
) -> Iterator[list[narrow.Run]]:
    ctx = multiprocessing.get_context("fork")
    procs, pipes = [], []
    try:
        for k in range(workers):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(reader, ranges[k::workers], send), daemon=True)
            proc.start()
            send.close()
            procs.append(proc)
            pipes.append(recv)
        for i in range(len(ranges)):
            pipe = pipes[i % workers]
            try:
                if not pipe.poll(READ_DEADLINE):
                    raise AuditUnavailable(
                        f"cannot read the audit store {where}: a page was not read within {READ_DEADLINE:g} s"
                    )
                kind, value = pipe.recv()
            except (EOFError, OSError):
                ended = "audit verify: a reading process ended early (killed?): run verify again"
                raise AuditUnavailable(ended) from None
            if kind != "runs":
                raise error(Exception(value))(f"cannot read the audit store {where}: {value}")
            yield value
    finally:
        for recv in pipes:
            recv.close()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()


def _child(reader: tuple[Callable[[], Any], str], ranges: list[tuple[int, int]], out: Any) -> None:
    """Render `ranges` of the store `reader` reads (connect, select of a range) and send each as ("runs", runs)
    (or ("error", text)). Ctrl-C is the parent's to handle (it stops the children): ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        connect, select = reader
        conn = connect()
        pg = "%s" in select
        if pg:
            from mrtr_keys.audit.writing.stores.postgres import merged_rows

        def names() -> dict[int, str]:
            return {int(i): str(n) for i, n in conn.execute("SELECT id, name FROM audit_names").fetchall()}

        codec = narrow.Codec()
        codec.learn(names())
        view = narrow.Pieces(codec, names, lambda lo, hi: [])
        for lo, hi in ranges:
            rows = conn.execute(select, (lo, hi)).fetchall()
            out.send(("runs", view.runs(merged_rows(rows) if pg else rows)))  # PostgreSQL: its odd-text columns
            del rows
    except Exception as exc:
        try:
            out.send(("error", str(exc)))
        except OSError:
            pass
    finally:
        out.close()
