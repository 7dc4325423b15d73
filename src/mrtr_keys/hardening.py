"""Key-holding processes that cannot be read: no debugger attach, no ``/proc/PID/mem``, no core file.

A process that holds ring keys (a library codec's server, the sealing sidecar and its workers) or the audit
key (the audit writer child) is, by default, an ordinary process: where the host allows ptrace between one
user's processes (no Yama restriction), any other process of that user can attach a debugger or read its
``/proc/PID/mem`` and ``/proc/PID/environ``, and a crash writes a core file holding the keys. `harden_process`
closes both, as Vault (``RLIMIT_CORE``) and Asherah (non-dumpable key memory) do:

* ``prctl(PR_SET_DUMPABLE, 0)`` (Linux, prctl(2)): the kernel then lets only a process with
  ``CAP_SYS_PTRACE`` (root) attach or open ``/proc/PID/mem``, ``environ``, ``maps`` and ``fd``, and writes
  no core dump of the process (core(5));
* ``RLIMIT_CORE`` 0, soft and hard (setrlimit(2)): no core file even where another setting would allow one.

The flag is reset by ``execve``, so every process that holds keys calls this itself, early, before it
reads any: the sidecar (`mrtr_keys.service.server`) and each of its workers, the audit writer child and the
retention child (told by the parent through `CHILD_FLAG` whether core dumps are allowed), and the example
MCP server. ``--allow-core-dumps`` (``MRTR_KEYS_ALLOW_CORE_DUMPS=1``) leaves a process as it was, for a
debugger or a profiler run as the same user; py-spy and other samplers run as root read a hardened process
anyway. On other systems than Linux nothing is changed and `harden_process` says so (one line).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

ENV_ALLOW_CORE_DUMPS = "MRTR_KEYS_ALLOW_CORE_DUMPS"
"""``1`` / ``true``: leave processes dumpable and core dumps as the system sets them (debugging only)."""
CHILD_FLAG = "--allow-core-dumps"
"""The argument a key-holding child process (audit writer, retention) is started with when its parent allows
core dumps; without it the child hardens itself before it reads anything from its parent."""

_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
"""prctl(2) options (linux/prctl.h)."""

_allowed: bool | None = None
"""The last `harden_process` decision in this process (None: never asked)."""


@dataclass(frozen=True, slots=True)
class Hardening:
    """What `harden_process` left: `hardened` (non-dumpable and no core file), and `note`, one line saying so."""

    hardened: bool
    note: str


def allow_core_dumps_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``MRTR_KEYS_ALLOW_CORE_DUMPS`` is ``1``, ``true`` or ``yes`` (any case)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_ALLOW_CORE_DUMPS, "").strip().lower() in ("1", "true", "yes")


def core_dumps_allowed() -> bool:
    """Whether this process allowed core dumps (`harden_process`), else ``MRTR_KEYS_ALLOW_CORE_DUMPS``: what
    a key-holding child process is told (`child_args`)."""
    return allow_core_dumps_from_env() if _allowed is None else _allowed


def child_args() -> list[str]:
    """Arguments for a key-holding child process: `CHILD_FLAG` when core dumps are allowed here, else none."""
    return [CHILD_FLAG] if core_dumps_allowed() else []


def harden_process(*, allow_core_dumps: bool | None = None) -> Hardening:
    """Make this process non-dumpable and set its ``RLIMIT_CORE`` to 0 (see the module docstring).

    Call it at start, before the process reads any key; calling it again is harmless.

    Args:
        allow_core_dumps: True leaves the process as it is (debugging); None reads
            ``MRTR_KEYS_ALLOW_CORE_DUMPS``.

    Returns:
        `Hardening`: whether the process is hardened, and one line for a log. Never raises: a system without
        prctl(2) (not Linux) or a refused call is reported in the note, and the process runs on.
    """
    global _allowed
    allow = allow_core_dumps_from_env() if allow_core_dumps is None else bool(allow_core_dumps)
    _allowed = allow
    if allow:
        return Hardening(
            False,
            "core dumps allowed (--allow-core-dumps): other processes of this user can attach to this process "
            "and read its keys, and a crash can write them to a core file",
        )
    if not sys.platform.startswith("linux"):
        return Hardening(False, f"process hardening (non-dumpable, no core file) is Linux only; not on {sys.platform}")
    import resource

    problems: list[str] = []
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (OSError, ValueError) as exc:
        problems.append(f"RLIMIT_CORE: {exc}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        problems.append(f"prctl(PR_SET_DUMPABLE): {os.strerror(ctypes.get_errno())}")
    elif libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
        problems.append("prctl(PR_SET_DUMPABLE) did not hold")
    if problems:
        return Hardening(False, "process hardening incomplete: " + "; ".join(problems))
    return Hardening(True, "process hardened: not dumpable, no core file")
