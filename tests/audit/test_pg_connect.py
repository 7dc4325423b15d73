"""A PostgreSQL audit store whose server is silent: each connect that gives up closes its socket at once.

psycopg leaves a failed attempt's socket to the attempt's frames, which its error's traceback holds in a cycle;
until a garbage collection ran, every attempt that timed out kept its socket, and once the network healed the
server got a backend for each. Issue 40's chaos run found it: an audit writer process behind a blackholed link
went from 5 open files to 12 and kept them (the replay store had been mended the same way before).
"""

from __future__ import annotations

import gc
import time

import pytest

from mrtr_keys.audit.writing.stores.postgres import PostgresStore
from mrtr_keys.errors import AuditUnavailable
from tests.support.net import closed_by_peer, silent_server


def test_a_postgres_audit_connect_that_timed_out_leaves_no_socket_open() -> None:
    with silent_server() as (port, held):  # accepts (the kernel's backlog) and never answers
        gc.disable()  # what is asserted must not depend on when a collection runs
        try:
            with pytest.raises(AuditUnavailable, match="cannot connect to the audit store"):
                PostgresStore(f"postgresql://u@127.0.0.1:{port}/db")
            time.sleep(0.2)
            assert len(held) == 1 and all(closed_by_peer(s) for s in held)
        finally:
            gc.enable()
