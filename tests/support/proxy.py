"""`CountingProxy`: the one loopback TCP proxy of the tests and the benchmark.

It forwards 127.0.0.1:`port` to a target port, one thread per direction and connection, and:

* counts HTTP/1.x requests as they go up (before the target sees them), by a key `classify(head)`
  picks from the request head (default ``"request"``): `calls` (a Counter), `count`, `reset()`;
  ``http=False`` forwards any protocol (PostgreSQL, Redis) without looking at it;
* can rewrite response bodies (`response_hook(key, body) -> body`, Content-Length fixed up), to play
  a misbehaving server;
* simulates an outage: `stop()` cuts every open connection and refuses new ones; `start()` accepts
  again **on the same port**. The port stays reserved while stopped (a bound socket sharing it with
  SO_REUSEPORT that never listens), so nothing else can take it and a client sees "connection refused",
  as when the real service is down;
* plays the half failures through `faults` (`tests.support.faults.Faults`): blackhole, latency, reset
  after N bytes, flap.

Use it as a context manager or call `close()`.
"""

from __future__ import annotations

import select
import socket
import threading
from collections import Counter
from collections.abc import Callable
from types import TracebackType

from tests.support.faults import Faults

Classify = Callable[[bytes], str]
ResponseHook = Callable[[str, bytes], bytes]

_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 1 << 20


def header(head: bytes, name: bytes) -> bytes | None:
    """The value of header `name` (lower-case) in an HTTP head, or None."""
    for line in head.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip()
    return None


def _content_length(head: bytes) -> int | None:
    value = header(head, b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


class CountingProxy:
    """A loopback TCP proxy to 127.0.0.1:`target_port` (see the module docstring).

    Args:
        target_port: where connections go.
        classify: request head -> counting key (default: every request counts as ``"request"``).
        http: False to forward bytes without parsing (no counting, no hook).
    """

    def __init__(self, target_port: int, *, classify: Classify | None = None, http: bool = True) -> None:
        self.target_port = target_port
        self.classify: Classify = classify or (lambda head: "request")
        self.http = http
        self.response_hook: ResponseHook | None = None
        self.calls: Counter[str] = Counter()
        self.bytes_up = 0
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._holder: socket.socket | None = None
        self.faults = Faults(self)
        """The half failures (blackhole, latency, reset after N bytes, flap): see `Faults`."""
        first = self._bind(0)
        self.port = int(first.getsockname()[1])
        self._listen(first)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    addr = url

    @property
    def count(self) -> int:
        """Requests counted so far (every attempt, retries included)."""
        with self._lock:
            return sum(self.calls.values())

    @property
    def requests(self) -> int:
        return self.count

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.bytes_up = 0

    # ------------------------------------------------------------------ outage

    def stop(self) -> None:
        """Refuse new connections and cut the open ones (the target is "down"); the port stays reserved."""
        with self._lock:
            if self._listener is None:
                return
            self._holder = self._bind(self.port)
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        _close(listener)
        for c in conns:
            _close(c)

    def start(self) -> None:
        """Accept connections again on the same port (the target is "back")."""
        with self._lock:
            if self._listener is not None:
                return
            listener = self._bind(self.port)
            holder, self._holder = self._holder, None
        self._listen(listener)
        if holder is not None:
            holder.close()

    def close(self) -> None:
        """Stop for good and release the port (connections held by a blackhole are let go: they end on their
        closed sockets)."""
        self.stop()
        self.faults.stop_flapping()
        self.faults.restore()
        with self._lock:
            holder, self._holder = self._holder, None
        if holder is not None:
            holder.close()

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    @staticmethod
    def _bind(port: int) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", port))
        return s

    def _listen(self, listener: socket.socket) -> None:
        listener.listen(256)
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                if self._listener is not listener:  # stopped meanwhile
                    _close(client)
                    return
                self._conns.add(client)
            threading.Thread(target=self._connect, args=(listener, client), daemon=True).start()

    def _connect(self, listener: socket.socket, client: socket.socket) -> None:
        """Join `client` to a new connection to the target, once no blackhole holds it: a connection made
        during a blackhole never reaches the target, as behind a dropped route (and a PostgreSQL server would
        otherwise keep a backend for each held connection until its authentication timeout: hundreds of
        them, from callers that give up and retry, use up its connection slots for every other client)."""
        self.faults.wait_open()
        if _gone(client):  # gave up while held: nothing to join (hundreds of such after a long blackhole)
            with self._lock:
                self._conns.discard(client)
            _close(client)
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            upstream.settimeout(None)
        except OSError:
            with self._lock:
                self._conns.discard(client)
            _close(client)
            return
        with self._lock:
            if self._listener is not listener or client not in self._conns:  # stopped or closed meanwhile
                _close(client)
                _close(upstream)
                return
            self._conns.add(upstream)
        keys: list[str] = []
        threading.Thread(target=self._up, args=(client, upstream, keys), daemon=True).start()
        threading.Thread(target=self._down, args=(upstream, client, keys), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket, keys: list[str]) -> None:
        """Client to target: count each request head before forwarding it."""
        buf = b""
        skip = 0  # body bytes of the current request still to pass
        parse = self.http
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.bytes_up += len(data)
                if parse:
                    buf += data
                    while buf:
                        if skip:
                            n = min(skip, len(buf))
                            skip -= n
                            buf = buf[n:]
                            continue
                        end = buf.find(_HEAD_END)
                        if end < 0:
                            parse = len(buf) <= _MAX_HEAD
                            break
                        head, buf = buf[: end + 4], buf[end + 4 :]
                        key = self.classify(head)
                        keys.append(key)
                        with self._lock:
                            self.calls[key] += 1
                        skip = _content_length(head) or 0
                    if not parse:
                        buf = b""
                out = self.faults.gate("up", id(src), data)
                if out is None:
                    return
                dst.sendall(out)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    def _down(self, src: socket.socket, dst: socket.socket, keys: list[str]) -> None:
        """Target to client: raw, unless a response hook is set (then whole Content-Length responses)."""
        buf = b""
        try:
            while data := src.recv(65536):
                gated = self.faults.gate("down", id(dst), data)
                if gated is None:
                    buf = b""
                    return
                data = gated
                if self.response_hook is None and not buf:
                    dst.sendall(data)
                    continue
                buf += data
                while (end := buf.find(_HEAD_END)) >= 0:
                    head = buf[: end + 4]
                    length = _content_length(head)
                    if length is None:  # chunked or until close: pass through as is
                        dst.sendall(buf)
                        buf = b""
                        break
                    if len(buf) < end + 4 + length:
                        break
                    body, buf = buf[end + 4 : end + 4 + length], buf[end + 4 + length :]
                    key = keys.pop(0) if keys else "?"
                    hook = self.response_hook
                    if hook is not None and not head.startswith(b"HTTP/1.1 1"):
                        new = hook(key, body)
                        head = _with_length(head, len(new))
                        body = new
                    dst.sendall(head + body)
        except OSError:
            pass
        finally:
            if buf:
                try:
                    dst.sendall(buf)
                except OSError:
                    pass
            _close(src)
            _close(dst)


def _with_length(head: bytes, length: int) -> bytes:
    lines = head[:-4].split(b"\r\n")
    out = [lines[0]]
    for line in lines[1:]:
        name = line.partition(b":")[0].strip().lower()
        out.append(b"Content-Length: %d" % length if name == b"content-length" else line)
    return b"\r\n".join(out) + _HEAD_END


def _gone(sock: socket.socket) -> bool:
    """True if the peer of `sock` has closed or reset it, even with bytes it sent still unread (Linux's
    ``POLLRDHUP``: a client that sent its greeting and then gave up)."""
    if sock.fileno() < 0:  # closed here meanwhile (the proxy was stopped)
        return True
    poller = select.poll()
    hangup = select.POLLRDHUP | select.POLLHUP | select.POLLERR
    poller.register(sock, hangup)
    return any(events & hangup for _, events in poller.poll(0))


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass


def amz_operation(head: bytes) -> str:
    """`classify` for AWS JSON APIs: the operation from ``X-Amz-Target`` (``TrentService.Decrypt`` -> ``Decrypt``)."""
    target = header(head, b"x-amz-target")
    return target.decode("latin-1").rsplit(".", 1)[-1] if target else "?"
