"""``python -m bench chaos``: the whole system under seeded, replayable, overlapping faults (issue 40).

A fleet (`bench.chaos.fleet`: library codecs inside real MCP servers and sealing sidecars, mixed, on one
OpenBao KV v2 key ring, with PostgreSQL for presence and audit and Redis for single-use rounds, every
dependency of every process behind its own fault proxy) serves continuous crossing multi-round trips and a
forger (`bench.chaos.traffic`) while ``mrtr-keys rotate next --wait`` rotates a 30 s-TTL ring end to end
(`bench.chaos.rotator`). The nemesis (`bench.chaos.nemesis`) plays a seeded schedule of faults
(`bench.chaos.schedule`); the checker (`bench.chaos.checker`, `bench.chaos.audit_check`,
`bench.chaos.resources`) holds the invariants of docs/reliability.md against what the clients saw, the
audit log, presence and /readyz, and names every violation with its time, the faults active then and the
evidence. `bench.chaos.run` puts them together; `bench.chaos.cli` is the command line.
"""
