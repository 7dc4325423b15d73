"""Loopback ports and processes for tests and the benchmark, without relying on luck.

A port found free is only free until someone else binds it (a busy host runs many test processes and
has thousands of sockets in TIME-WAIT). So nothing here assumes a port stays free:

* `launch_on_free_port(start)` picks a port (bind to port 0), starts the server on it, and if the server
  exits saying the address is in use, starts it again on a new port (a few times);
* `refused_port()` holds a bound socket that never listens, so connections to its port are refused for
  as long as the ``with`` block lasts (an "unreachable service" that no one can start there meanwhile);
* `wait_for_port` / `stop_process` wait for a listener and stop a process (terminate, then kill);
* `silent_server()` accepts every connection and never answers (a hung server), and `closed_by_peer` says
  whether a client closed a connection it held.
"""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IN_USE = "address already in use"
"""How servers (Go's net, Python's errno 98, our CLI) word EADDRINUSE, lower-cased."""


class ProcessExited(RuntimeError):
    """A server process exited before it was ready; `output` is what it printed."""

    def __init__(self, returncode: int | None, output: str) -> None:
        super().__init__(f"process exited with {returncode} before it was ready: {output[-3000:]!r}")
        self.returncode = returncode
        self.output = output


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago: only for `launch_on_free_port`, which retries."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def refused_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port where connections are refused while the block runs (bound, never listening)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
        yield int(s.getsockname()[1])
    finally:
        s.close()


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """True if something accepts TCP connections on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def wait_for_port(
    port: int,
    *,
    host: str = "127.0.0.1",
    timeout: float = 30.0,
    proc: subprocess.Popen[Any] | None = None,
    output: Callable[[], str] | None = None,
) -> None:
    """Block until something accepts connections on host:port.

    Raises:
        ProcessExited: `proc` exited first (with its output, from `output` or its stdout pipe).
        TimeoutError: nothing listened within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ProcessExited(proc.returncode, _output(proc, output))
        if port_open(port, host):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout} s")


def _output(proc: subprocess.Popen[Any], output: Callable[[], str] | None) -> str:
    if output is not None:
        return output()
    if proc.stdout is not None:
        data = proc.stdout.read()
        return data.decode(errors="replace") if isinstance(data, bytes) else str(data)
    return ""


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Terminate, then kill if it does not exit within `timeout` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


@dataclass
class Launched:
    """A server started by `launch_on_free_port`: its process, port and log file."""

    proc: subprocess.Popen[Any]
    port: int
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def launch_on_free_port(
    start: Callable[[int], tuple[subprocess.Popen[Any], Path]],
    *,
    ready: Callable[[int], bool] = port_open,
    attempts: int = 8,
    timeout: float = 60.0,
) -> Launched:
    """Start a server on a free loopback port, again on another port if that one was taken meanwhile.

    Args:
        start: starts the server on the given port; returns its process and the file its output goes to.
        ready: True once the server on that port answers (default: it accepts TCP connections).
        attempts: how many ports to try when the server reports the address in use.
        timeout: seconds each attempt may take to become ready.

    Raises:
        ProcessExited: the server exited for another reason (its output is in the message).
        TimeoutError: it did not become ready within `timeout` seconds.
    """
    last: ProcessExited | None = None
    for _ in range(attempts):
        port = free_port()
        proc, log = start(port)
        launched = Launched(proc, port, log)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if proc.poll() is not None:
                    raise ProcessExited(proc.returncode, launched.output())
                if ready(port) and proc.poll() is None:
                    return launched
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"server on port {port} not ready after {timeout} s: {launched.output()[-3000:]}"
                    )
                time.sleep(0.05)
        except ProcessExited as exc:
            if IN_USE not in exc.output.lower():
                raise
            last = exc
        except BaseException:
            stop_process(proc)
            raise
    assert last is not None
    raise last


@contextlib.contextmanager
def silent_server(host: str = "127.0.0.1") -> Iterator[tuple[int, list[socket.socket]]]:
    """(port, the connections it holds): a listener that accepts every connection and never answers, as a
    hung server does; it and what it accepted are closed at the end of the block."""
    listener = socket.create_server((host, 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, name="silent-server", daemon=True).start()
    try:
        yield int(listener.getsockname()[1]), held
    finally:
        listener.close()
        for sock in held:
            sock.close()


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the other end of `sock` has closed or shut down its side (POLLRDHUP / POLLHUP)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP)
    return bool(poller.poll(0))
