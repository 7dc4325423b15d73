/**
 * A real `mrtr-keys serve` for the node tests, on a Unix socket in a fresh temporary directory (no port
 * to race for). The CLI is `MRTR_KEYS_CLI` (the Makefile sets it), else the repository's
 * `.venv/bin/mrtr-keys`.
 */

import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import http from 'node:http';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';

export const CLI = process.env.MRTR_KEYS_CLI ?? resolve(import.meta.dirname ?? '.', '../../../../.venv/bin/mrtr-keys');

export interface RunningSidecar {
  url: string;
  dir: string;
  ring: string;
  /** `mrtr-keys clients add NAME --audience A... --json`; returns the secret. */
  addClient(name: string, ...audiences: string[]): string;
  stop(): Promise<void>;
  log(): string;
}

function healthy(socketPath: string): Promise<boolean> {
  return new Promise((done) => {
    const req = http.get({ socketPath, path: '/healthz', timeout: 500 }, (res) => {
      res.resume();
      done(res.statusCode === 200);
    });
    req.on('error', () => done(false));
    req.on('timeout', () => req.destroy());
  });
}

export async function startSidecar(...audiences: string[]): Promise<RunningSidecar> {
  if (!existsSync(CLI)) throw new Error(`mrtr-keys not found at ${CLI}: run make .venv/.installed or set MRTR_KEYS_CLI`);
  const dir = mkdtempSync(join(tmpdir(), 'mrtr-ts-'));
  const ring = join(dir, 'ring', 'keyring.json');
  const env = { ...process.env, MRTR_KEYS_KEYSTORE: ring, MRTR_KEYS_AUDIT: 'off' };
  execFileSync(CLI, ['init', ...audiences.flatMap((a) => ['--audience', a])], { env, stdio: 'pipe' });
  const socket = join(dir, 'sidecar.sock');
  const logPath = join(dir, 'sidecar.log');
  const { openSync } = await import('node:fs');
  const out = openSync(logPath, 'w');
  const proc: ChildProcess = spawn(CLI, ['serve', '--uds', socket, '--reload-interval', '0.2'], {
    env,
    stdio: ['ignore', out, out]
  });
  const log = () => (existsSync(logPath) ? readFileSync(logPath, 'utf8') : '');
  const deadline = Date.now() + 60_000;
  while (!(await healthy(socket))) {
    if (proc.exitCode !== null) throw new Error(`sidecar exited: ${log()}`);
    if (Date.now() > deadline) {
      proc.kill();
      throw new Error(`sidecar not healthy after 60 s: ${log()}`);
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  return {
    url: `unix://${socket}`,
    dir,
    ring,
    log,
    addClient(name: string, ...granted: string[]): string {
      const out = execFileSync(CLI, ['clients', 'add', name, ...granted.flatMap((a) => ['--audience', a]), '--json'], {
        env,
        encoding: 'utf8'
      });
      return (JSON.parse(out) as { secret: string }).secret;
    },
    async stop(): Promise<void> {
      if (proc.exitCode === null) {
        const exited = new Promise((r) => proc.once('exit', r));
        proc.kill('SIGTERM');
        await exited;
      }
      rmSync(dir, { recursive: true, force: true });
    }
  };
}
