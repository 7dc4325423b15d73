"""Helpers the tests and the benchmark share (plain modules, no pytest): one of each, used by both.

* `tests.support.net`: free ports that do not depend on luck (`launch_on_free_port` retries a server
  whose port was taken in the meantime; `refused_port` holds a port nobody listens on), waiting for a
  port, stopping a process.
* `tests.support.proxy`: `CountingProxy`, the one loopback TCP proxy: counts HTTP requests (by a key a
  test chooses), can rewrite responses, and `stop()` / `start()` simulate an outage of whatever is behind
  it (PostgreSQL, OpenBao, KMS, Redis) without touching that service.
* `tests.support.services`: launchers for an OpenBao dev server, a moto server and ``mrtr-keys serve``.

``python -m bench`` imports them from the repository root, as pytest does.
"""
