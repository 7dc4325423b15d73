"""One retention run in its own process (``python -m mrtr_keys.audit.retention.child``), at low priority.

A prune walks and hashes every record it cuts: pure Python work. Run as a thread of the sidecar it took
the interpreter lock from the request loop, and a sidecar's seal+unseal p99 rose to about 3x while a
prune ran (bench part ``audit_scale``, retention rows). In a child process at ``nice`` 10 it competes
for a core only, and the scheduler gives requests the precedence.

Protocol: the parent writes one JSON object on stdin, ``{"url", "checkpoints", "before", "now",
"deadline", "libpq", "chain_keys"}`` (the store URL may hold a password, libpq's ``PG*`` variables
may too, and the chain keys, hex, are secrets: they travel through this pipe only, never argv or the
environment: the environment is `mrtr_keys.audit.writing.writer.child_writer.child_environment`), then closes
it. The child prints one JSON object on stdout: ``{"ok": true, "deleted": N, "seconds": S}``,
``{"ok": false, "error": "one line"}`` or ``{"ok": false, "skipped": true}`` (another process holds
the checkpoint file's lock). SIGTERM stops the verifying walk at its next page (nothing deleted); a
deletion under way runs to its end, as the cut is already recorded.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from mrtr_keys.hardening import CHILD_FLAG, harden_process

NICENESS = 10
"""Added to the child's scheduling niceness: the sidecar's requests come first on a busy host."""


def run(request: dict[str, Any], stopping: list[bool]) -> dict[str, Any]:
    """One prune per `request` (see the module docstring); `stopping[0]` turns True on SIGTERM."""
    from mrtr_keys.audit.events import plural
    from mrtr_keys.audit.retention.prune import prune, pruner_lock
    from mrtr_keys.audit.verifying.ledger import FileLedger
    from mrtr_keys.audit.verifying.store_match import checkpoints_of
    from mrtr_keys.audit.writing.chain_key import ChainKey, ChainKeys
    from mrtr_keys.audit.writing.stores.url import open_store
    from mrtr_keys.errors import MrtrKeysError
    from mrtr_keys.urls import remember, scrub

    remember(request["url"])
    given = [ChainKey.from_material(bytes.fromhex(k)) for k in request.get("chain_keys") or ()]
    keys = ChainKeys(given) if given else None
    started = time.monotonic()
    deadline = float(request["deadline"])

    def progress(phase: str, records: int, elapsed: float) -> None:
        if phase == "verify" and (stopping[0] or time.monotonic() - started > deadline):
            raise MrtrKeysError(
                f"audit retention: the verifying walk passed its {deadline:g} s deadline after "
                f"{plural(records, 'record', grouped=True)} (nothing deleted; tried again next interval)"
                if not stopping[0]
                else "audit retention: stopped during the verifying walk (nothing deleted)"
            )

    try:
        with pruner_lock(request["checkpoints"]) as held:
            if not held:
                return {"ok": False, "skipped": True}
            store: Any = open_store(request["url"])
            try:
                docs = checkpoints_of(FileLedger(Path(request["checkpoints"])).read(), store).docs
                result = prune(
                    store,
                    request["before"],
                    docs,
                    str(request["checkpoints"]),
                    now=float(request["now"]),
                    progress=progress,
                    keys=keys,
                )
            finally:
                store.close()
    except MrtrKeysError as exc:
        return {"ok": False, "error": scrub(str(exc))}
    except Exception as exc:  # one line for the parent's status, never a traceback (credentials scrubbed)
        return {"ok": False, "error": scrub(f"audit retention: {type(exc).__name__}: {exc}")}
    return {"ok": True, "deleted": result.deleted, "seconds": result.seconds}


def main() -> int:
    """Read the request, run it, print the result (see the module docstring). Returns the exit status."""
    stopping = [False]

    def stop(_sig: int, _frame: object) -> None:
        stopping[0] = True

    harden_process(allow_core_dumps=CHILD_FLAG in sys.argv[1:])  # before the store URL arrives
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the sidecar, which stops this run
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    out = os.dup(1)
    os.dup2(2, 1)  # a stray print must not corrupt the result
    request = json.loads(sys.stdin.read())
    os.environ.update(request.pop("libpq", {}))  # for libpq only; not in /proc/PID/environ
    result = run(request, stopping)
    os.write(out, (json.dumps(result) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
