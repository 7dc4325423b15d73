"""The sidecar's default HTTP protocol: `LimitedHttpToolsProtocol` (the connection limits) writing each
response in one socket write.

**Corked writes** (`CorkedHttpToolsProtocol`, the default; ``http = "httptools"`` switches it off):
uvicorn writes the status line and headers on ``http.response.start`` and the body on
``http.response.body``: two ``send`` system calls per small response, which on loopback was the largest
single cost of a seal. `CorkedTransport` buffers the writes a callback makes and hands them to the real
transport in one ``writelines`` (one ``writev``) at the end of the current event-loop iteration
(``loop.call_soon``), so header and body leave together. Ordering is unchanged; ``close`` and
``write_eof`` flush first. Everything else is delegated to the real transport (flow control included).
"""

from __future__ import annotations

import asyncio
from typing import Any

from mrtr_keys.service.protocol import LimitedHttpToolsProtocol


class CorkedTransport:
    """A transport proxy coalescing the writes of one loop iteration (see the module docstring)."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        held = self._held
        if held is None:
            self._held = [data]
            self._loop.call_soon(self._flush)
        else:
            held.append(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if not held or self._transport.is_closing():
            return
        if len(held) == 1:
            self._transport.write(held[0])
        else:
            self._transport.writelines(held)

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CorkedHttpToolsProtocol(LimitedHttpToolsProtocol):
    """`LimitedHttpToolsProtocol` over a `CorkedTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CorkedTransport(transport, self.loop))  # type: ignore[arg-type]
