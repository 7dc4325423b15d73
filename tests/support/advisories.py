"""A vulnerability service on a loopback port, for `make deps-audit`'s tests (tools/deps_audit.py).

It answers the two APIs the audit's real clients call, with the advisories a test gives it:

* OSV's ``POST /v1/query`` (what pip-audit sends with ``--osv-url``): ``{"package": {"name", "ecosystem"},
  "version"}`` -> ``{"vulns": [OSV records]}``, or ``{}`` when nothing is known (https://osv.dev/docs/#tag/api);
* the npm registry's ``POST /-/npm/v1/security/advisories/bulk`` (what ``npm audit`` sends to ``--registry``):
  ``{name: [versions]}``, gzip or not -> ``{name: [advisories]}``.

Every query is recorded (`asked`), so a test sees that each locked package was checked; `delay` makes each answer
late (a slow service). `silent_port` is the other kind of outage: a port that accepts connections and never
answers.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def osv_record(
    vuln_id: str, package: str, *, fixed: str, aliases: tuple[str, ...] = (), summary: str = ""
) -> dict[str, Any]:
    """An OSV record (schema 1.6) of a PyPI package, affected from its first release until `fixed`."""
    return {
        "schema_version": "1.6.0",
        "id": vuln_id,
        "aliases": list(aliases),
        "summary": summary or f"a test advisory for {package}",
        "published": "2026-11-30T00:00:00Z",
        "affected": [
            {
                "package": {"name": package, "ecosystem": "PyPI", "purl": f"pkg:pypi/{package}"},
                "ranges": [{"type": "ECOSYSTEM", "events": [{"introduced": "0"}, {"fixed": fixed}]}],
            }
        ],
    }


def npm_advisory(number: int, ghsa: str, *, title: str, vulnerable: str) -> dict[str, Any]:
    """One advisory as the bulk endpoint returns it."""
    return {
        "id": number,
        "url": f"https://github.com/advisories/{ghsa}",
        "title": title,
        "severity": "high",
        "vulnerable_versions": vulnerable,
        "cwe": ["CWE-400"],
        "cvss": {"score": 7.5, "vectorString": "CVSS:3.1/AV:N/AC:L/PR:N/UI:N/S:U/C:N/I:N/A:H"},
    }


class AdvisoryServer:
    """OSV and npm advisories on 127.0.0.1:`port` until `close`."""

    def __init__(self) -> None:
        self.osv: dict[tuple[str, str], list[dict[str, Any]]] = {}  # (PyPI name, version) -> OSV records
        self.npm: dict[str, list[dict[str, Any]]] = {}  # package name -> advisories (all versions)
        self.asked: list[tuple[str, str]] = []
        self.delay = 0.0  # seconds before each answer: a slow service
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: pip-audit asks one package a request, on one session

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                query = json.loads(body or b"{}")
                time.sleep(server.delay)
                if self.path == "/v1/query":
                    answer = server._osv(query)
                elif self.path == "/-/npm/v1/security/advisories/bulk":
                    answer = server._npm(query)
                else:
                    self.send_error(404)
                    return
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._http.server_address[1])
        self._thread = threading.Thread(target=self._http.serve_forever, name="advisories", daemon=True)
        self._thread.start()

    @property
    def osv_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/query"

    @property
    def registry(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def _osv(self, query: dict[str, Any]) -> dict[str, Any]:
        key = (query["package"]["name"], query["version"])
        with self._lock:
            self.asked.append(key)
        vulns = self.osv.get(key, [])
        return {"vulns": vulns} if vulns else {}

    def _npm(self, query: dict[str, list[str]]) -> dict[str, Any]:
        with self._lock:
            self.asked.extend((name, v) for name, versions in query.items() for v in versions)
        return {name: self.npm[name] for name in query if name in self.npm}

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)


@contextmanager
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections (the kernel's backlog) and never answers a byte."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield int(s.getsockname()[1])
    finally:
        s.close()
