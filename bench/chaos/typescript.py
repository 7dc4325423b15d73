"""The TypeScript side of the chaos clients, where ``node`` is on PATH (clients/typescript, docs/typescript.md).

Two TypeScript MCP servers (clients/typescript/test/e2e/server.ts: `createSidecarRequestStateCodec`), ``ts-1``
sealing through the first sidecar and ``ts-2`` through the last, sit behind one round-robin proxy that sends
each *request* to the next server (`tests.typescript.stack.RoundRobinProxy`), so the TypeScript MCP client
(test/e2e/client.ts, ``--until FILE --pace MS --log FILE``) runs crossing rounds: round 1 on one server, its
retry on the other, each opening the other's token through its own sidecar. The client logs each round with
its times; `rounds` turns them into `Round`s of kind ``ts`` (which server did what is not known: a round is
placed in time only). The TypeScript servers themselves are not faulted: their sidecars and the sidecars'
stores are.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from bench.chaos.fleet import AUDIENCE, Member
from bench.chaos.traffic import Round


class TsClients:
    def __init__(self, sidecars: list[Member], secret: str, ttl: float, workdir: Path, pace_ms: int = 500) -> None:
        self.sidecars = [sidecars[0], sidecars[-1]]
        self.secret = secret
        self.ttl = ttl
        self.workdir = workdir
        self.pace_ms = pace_ms
        self.log = workdir / "ts-rounds.jsonl"
        self.stop_file = workdir / "ts-stop"
        self.servers: list[Any] = []
        self.proxy: Any = None
        self.client: subprocess.Popen[str] | None = None
        self.summary: dict[str, Any] = {}

    def start(self) -> TsClients:
        from tests.typescript.stack import BUILD, NODE, RoundRobinProxy, ensure_built, start_ts_servers

        ensure_built()
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {"MRTR_KEYS_SIDECAR_SECRET": self.secret, "MRTR_TS_AUDIENCE": AUDIENCE, "MRTR_TS_TTL": f"{self.ttl:g}"}
        settings = {f"ts-{i}": {**env, "MRTR_KEYS_SIDECAR_URL": sc.base} for i, sc in enumerate(self.sidecars, 1)}
        self.servers = start_ts_servers(self.workdir, settings)
        self.proxy = RoundRobinProxy([s.port for s in self.servers])
        argv = [NODE or "node", str(BUILD / "client.js"), self.proxy.url, "--until", str(self.stop_file)]
        argv += ["--pace", str(self.pace_ms), "--log", str(self.log)]
        self.client = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return self

    def stop(self) -> None:
        """Stop the client (its rounds end), then the servers and the proxy; again: nothing."""
        self.stop_file.parent.mkdir(parents=True, exist_ok=True)
        self.stop_file.touch()
        client, self.client = self.client, None
        if client is not None:
            try:
                out, err = client.communicate(timeout=60)
                self.summary = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"stderr": err[-2000:]}
            except (subprocess.TimeoutExpired, ValueError):
                client.kill()
        for s in self.servers:
            s.stop()
        self.servers = []
        proxy, self.proxy = self.proxy, None
        if proxy is not None:
            proxy.close()

    def rounds(self) -> list[Round]:
        out: list[Round] = []
        if not self.log.exists():
            return out
        names = "+".join(s.name for s in self.sidecars)
        for line in self.log.read_text().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            t0, t1 = doc["t0"] / 1000.0, doc["t1"] / 1000.0
            r = Round("ts", names, names, t0=t0, t_sealed=t0, t_open=t0, outcome=doc["outcome"], detail=doc["error"])
            r.t1 = t1
            out.append(r)
        return out

    def errors_between(self, start: float, end: float) -> list[str]:
        """The TypeScript servers' ``onerror`` lines (their verify reasons) logged, in order (not timed)."""
        lines: list[str] = []
        for s in self.servers:
            lines += [f"{s.name}: {ln}" for ln in s.output().splitlines() if ln.startswith("onerror:")]
        return lines[-20:]
