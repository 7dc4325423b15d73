"""One TLS context for the tests' own HTTP clients (test harness only).

httpx and httpx2 build a new `ssl.SSLContext` for every client they make, loading the CA bundle into it:
about 35 ms of CPU each (measured on the 2-core test machine), for clients that mostly talk plain HTTP to
loopback servers. A test that makes a client per call or per poll paid that each time; a context is safe to
share between clients and threads. Pass it as ``verify=CONTEXT``.
"""

from __future__ import annotations

import ssl

CONTEXT = ssl.create_default_context()
