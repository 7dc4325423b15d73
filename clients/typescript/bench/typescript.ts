/**
 * The `typescript` part of `make bench` (bench/typescript.py runs it): one round = `mint` then `verify`,
 * timed per round, at each concurrency, for three subjects run interleaved:
 *
 * - `sidecar`: createSidecarRequestStateCodec through the sidecar (two HTTP requests a round);
 * - `floor`: two bare keep-alive `POST /healthz` to the same sidecar (same transport, no sealing);
 * - `hmac`: the SDK's in-process createRequestStateCodec (no I/O).
 *
 *   node typescript.js --concurrency 1,16 --rounds N --repeats R
 * Env: MRTR_KEYS_SIDECAR_URL, MRTR_KEYS_SIDECAR_SECRET, MRTR_BENCH_AUDIENCE.
 * Prints one JSON object: {"c1": {"sidecar": {"p50": [ms per repeat], "p99": [...]}, ...}, ...}.
 */

import http from 'node:http';

import { createRequestStateCodec, type RequestStateCodec, type ServerContext } from '@modelcontextprotocol/server';

import { createSidecarRequestStateCodec } from '../src/index.js';

const args = process.argv.slice(2);
const opt = (name: string, fallback: string): string => {
  const i = args.indexOf(name);
  return i >= 0 ? (args[i + 1] ?? fallback) : fallback;
};
const levels = opt('--concurrency', '1,16').split(',').map(Number);
const rounds = Number(opt('--rounds', '500'));
const repeats = Number(opt('--repeats', '5'));
const url = process.env.MRTR_KEYS_SIDECAR_URL ?? '';
const audience = process.env.MRTR_BENCH_AUDIENCE ?? 'bench';

const ctx = {} as ServerContext;
const payload = { step: 2, origin: 'LHR', dest: 'SFO', date: '2026-09-14', pax: 2, seat: 'x'.repeat(180) };

const sidecar = createSidecarRequestStateCodec<typeof payload>({ audience, timeoutMs: 10_000 });
const hmac: RequestStateCodec<typeof payload> = createRequestStateCodec({ key: 'k'.repeat(32) });

const target = new URL(url);
const agent = new http.Agent({ keepAlive: true, timeout: 5_000, scheduling: 'lifo' });
const healthBody = Buffer.from('{}');
function healthz(): Promise<void> {
  return new Promise((resolve, reject) => {
    const req = http.request(
      {
        host: target.hostname,
        port: target.port,
        method: 'POST',
        path: '/healthz',
        agent,
        headers: { 'content-type': 'application/json', 'content-length': healthBody.length }
      },
      (res) => {
        res.resume();
        res.on('end', resolve);
        res.on('error', reject);
      }
    );
    req.on('error', reject);
    req.end(healthBody);
  });
}

type Round = () => Promise<void>;
const subjects: Record<string, Round> = {
  sidecar: async () => {
    await sidecar.verify(await sidecar.mint(payload), ctx);
  },
  floor: async () => {
    await healthz();
    await healthz();
  },
  hmac: async () => {
    await hmac.verify(await hmac.mint(payload), ctx);
  }
};

function percentile(sorted: number[], q: number): number {
  if (sorted.length === 0) return Number.NaN;
  const i = Math.min(sorted.length - 1, Math.max(0, Math.ceil(q * sorted.length) - 1));
  return sorted[i] ?? Number.NaN;
}

async function measure(round: Round, concurrency: number, perWorker: number): Promise<{ p50: number; p99: number }> {
  const times: number[] = [];
  const worker = async (): Promise<void> => {
    for (let i = 0; i < perWorker; i++) {
      const t0 = performance.now();
      await round();
      times.push(performance.now() - t0);
    }
  };
  await Promise.all(Array.from({ length: concurrency }, worker));
  times.sort((a, b) => a - b);
  return { p50: percentile(times, 0.5), p99: percentile(times, 0.99) };
}

const out: Record<string, Record<string, { p50: number[]; p99: number[] }>> = {};
for (const c of levels) {
  const perWorker = Math.max(10, Math.ceil(rounds / Math.sqrt(c)));
  const level: Record<string, { p50: number[]; p99: number[] }> = {};
  for (const name of Object.keys(subjects)) level[name] = { p50: [], p99: [] };
  for (const round of Object.values(subjects)) await measure(round, c, Math.min(50, perWorker)); // warm up
  for (let r = 0; r < repeats; r++) {
    for (const [name, round] of Object.entries(subjects)) {
      const { p50, p99 } = await measure(round, c, perWorker);
      level[name]?.p50.push(p50);
      level[name]?.p99.push(p99);
    }
  }
  out[`c${c}`] = level;
}
sidecar.close();
agent.destroy();
console.log(JSON.stringify(out));
