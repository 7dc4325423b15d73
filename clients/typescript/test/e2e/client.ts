/**
 * The TypeScript client of the end-to-end tests: `provision` rounds against a URL with
 * `@modelcontextprotocol/client` (protocol 2026-07-28; the client fulfils the elicitation and retries
 * with the echoed `requestState`).
 *
 *   node client.js URL [--rounds N] [--concurrency C] [--until FILE] [--pace MS] [--header NAME=VALUE] [--log FILE]
 *
 * Runs N rounds (default 1), or until FILE exists; prints one JSON line:
 * `{"rounds":…, "ok":…, "rejected":…, "failed":…, "texts":{text: count}, "errors":[…]}` where `rejected`
 * counts -32602 answers and `failed` any other error. `--pace MS` waits MS milliseconds between a worker's rounds.
 * `--log FILE` appends one JSON line a round as it ends: `{"t0":…, "t1":…, "outcome":"ok"|"rejected"|"failed",
 * "error":…}` (times in ms since the epoch), for a harness that must place each round in time (bench/chaos).
 */

import { appendFileSync, existsSync } from 'node:fs';

import { Client, StreamableHTTPClientTransport } from '@modelcontextprotocol/client';

const args = process.argv.slice(2);
const url = args[0] ?? '';
const option = (name: string): string | undefined => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : undefined;
};
const rounds = Number(option('--rounds') ?? '1');
const concurrency = Number(option('--concurrency') ?? '1');
const until = option('--until');
const pace = Number(option('--pace') ?? '0');
const header = option('--header');
const log = option('--log');
const headers: Record<string, string> = {};
if (header) {
  const [name, value] = header.split('=', 2);
  headers[name ?? ''] = value ?? '';
}

const summary = { rounds: 0, ok: 0, rejected: 0, failed: 0, texts: {} as Record<string, number>, errors: [] as string[] };

async function connect(): Promise<Client> {
  const client = new Client(
    { name: 'mrtr-keys-e2e', version: '1.0.0' },
    { capabilities: { elicitation: { form: {} } }, versionNegotiation: { mode: 'auto' } }
  );
  client.setRequestHandler('elicitation/create', async () => ({ action: 'accept', content: { region: 'eu-west-1' } }));
  await client.connect(new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers } }));
  return client;
}

async function worker(): Promise<void> {
  const client = await connect();
  try {
    while (until ? !existsSync(until) : summary.rounds < rounds) {
      summary.rounds += 1;
      const t0 = Date.now();
      let outcome = 'ok';
      let message = '';
      try {
        const result = await client.callTool({ name: 'provision', arguments: { name: 'orders' } });
        const first = result.content?.[0];
        const text = first?.type === 'text' ? first.text : JSON.stringify(result);
        summary.texts[text] = (summary.texts[text] ?? 0) + 1;
        if (result.isError) {
          summary.failed += 1;
          summary.errors.push(text);
          [outcome, message] = ['failed', text];
        } else summary.ok += 1;
      } catch (error) {
        const code = (error as { code?: number }).code;
        if (code === -32602) summary.rejected += 1;
        else summary.failed += 1;
        message = `${code}: ${(error as Error).message}`;
        outcome = code === -32602 ? 'rejected' : 'failed';
        if (summary.errors.length < 20) summary.errors.push(message);
      }
      if (log) appendFileSync(log, JSON.stringify({ t0, t1: Date.now(), outcome, error: message }) + '\n');
      if (pace > 0) await new Promise((resolve) => setTimeout(resolve, pace));
    }
  } finally {
    await client.close();
  }
}

await Promise.all(Array.from({ length: concurrency }, () => worker()));
console.log(JSON.stringify(summary));
