/**
 * createSidecarRequestStateCodec against a real `mrtr-keys serve` (Unix socket): round trips, every
 * refusal with its reason code, options and environment defaults, a silent and a missing sidecar.
 */

import assert from 'node:assert/strict';
import { createServer, type Server, type Socket } from 'node:net';
import { after, before, describe, test } from 'node:test';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { createRequestStateCodec, type ServerContext } from '@modelcontextprotocol/server';

import {
  createSidecarRequestStateCodec,
  RequestStateError,
  SidecarConfigError,
  type RequestStateReason
} from '../src/index.js';
import { startSidecar, type RunningSidecar } from './sidecar.js';

let sidecar: RunningSidecar;
let secret: string;
let billingSecret: string;
const ctx = {} as ServerContext;
const withUser = (user: string) => ({ http: { req: new Request('http://x/', { headers: { 'x-user': user } }) } }) as unknown as ServerContext;

async function rejects(promise: Promise<unknown>, reason: RequestStateReason): Promise<void> {
  await assert.rejects(promise, (error: unknown) => {
    assert.ok(error instanceof RequestStateError, `not a RequestStateError: ${String(error)}`);
    assert.equal(error.reason, reason);
    assert.equal(error.message, reason);
    return true;
  });
}

before(async () => {
  sidecar = await startSidecar('orders', 'billing');
  secret = sidecar.addClient('ts-orders', 'orders');
  billingSecret = sidecar.addClient('ts-billing', 'billing');
});
after(async () => {
  await sidecar?.stop();
});

describe('round trip', () => {
  test('any JSON payload comes back as minted, and the token does not show it', async () => {
    const codec = createSidecarRequestStateCodec<unknown>({ sidecar: sidecar.url, secret, audience: 'orders' });
    for (const payload of [{ step: 'confirm', env: 'prod', n: [1, 2.5, null] }, 'text ünïcode ✓', 42, true, null, []]) {
      const token = await codec.mint(payload);
      assert.deepEqual(await codec.verify(token, ctx), payload);
      assert.ok(!token.includes('confirm') && !Buffer.from(token, 'base64url').toString('latin1').includes('confirm'));
    }
    codec.close();
  });

  test('mint and verify work detached, as ServerOptions.requestState.verify uses them', async () => {
    const { mint, verify } = createSidecarRequestStateCodec<{ a: number }>({ sidecar: sidecar.url, secret, audience: 'orders' });
    assert.deepEqual(await verify(await mint({ a: 1 }), ctx), { a: 1 });
  });

  test('defaults come from MRTR_KEYS_SIDECAR_URL and MRTR_KEYS_SIDECAR_SECRET', async () => {
    process.env.MRTR_KEYS_SIDECAR_URL = sidecar.url;
    process.env.MRTR_KEYS_SIDECAR_SECRET = secret;
    try {
      const codec = createSidecarRequestStateCodec<string>({ audience: 'orders' });
      assert.equal(await codec.verify(await codec.mint('from env'), ctx), 'from env');
      assert.equal(codec.sidecar, sidecar.url);
    } finally {
      delete process.env.MRTR_KEYS_SIDECAR_URL;
      delete process.env.MRTR_KEYS_SIDECAR_SECRET;
    }
  });

  test('check() reads the ring and refuses a ttl longer than the ring TTL', async () => {
    const ok = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret, audience: 'orders', ttlSeconds: 600 });
    const ring = await ok.check();
    assert.equal(ring.ttlSeconds, 600);
    assert.equal(typeof ring.generation, 'number');
    const long = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret, audience: 'orders', ttlSeconds: 601 });
    await assert.rejects(long.check(), SidecarConfigError);
    const wrong = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret: 'mks_wrong', audience: 'orders' });
    await assert.rejects(wrong.check(), /refused this client's secret/);
  });
});

describe('refusals', () => {
  test('a tampered token is rejected', async () => {
    const codec = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret, audience: 'orders' });
    const token = await codec.mint({ a: 1 });
    const i = Math.floor(token.length / 2);
    const tampered = token.slice(0, i) + (token[i] === 'A' ? 'B' : 'A') + token.slice(i + 1);
    await rejects(codec.verify(tampered, ctx), 'rejected');
    await rejects(codec.verify(token + 'A', ctx), 'rejected');
  });

  test('a token sealed for another audience is rejected', async () => {
    const billing = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret: billingSecret, audience: 'billing' });
    const orders = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret, audience: 'orders' });
    await rejects(orders.verify(await billing.mint({ a: 1 }), ctx), 'rejected');
  });

  test('an audience the client was not granted is forbidden, a wrong secret unauthorized', async () => {
    const notGranted = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret, audience: 'billing' });
    await rejects(notGranted.mint({ a: 1 }), 'forbidden');
    const orders = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret, audience: 'orders' });
    const token = await orders.mint({ a: 1 });
    await rejects(notGranted.verify(token, ctx), 'forbidden');
    const wrong = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret: 'mks_wrong', audience: 'orders' });
    await rejects(wrong.mint({ a: 1 }), 'unauthorized');
    await rejects(wrong.verify(token, ctx), 'unauthorized');
  });

  test('expired, and minted more than 60 s in the future (the Python SDK rule)', async () => {
    let now = Date.now();
    const codec = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret, audience: 'orders', ttlSeconds: 10, clock: () => now });
    const token = await codec.mint({ a: 1 });
    now += 9_999;
    assert.deepEqual(await codec.verify(token, ctx), { a: 1 });
    now += 1;
    await rejects(codec.verify(token, ctx), 'expired');
    const later = await codec.mint({ a: 2 }); // iat = now
    now -= 60_000; // verifier's clock 60 s behind: still accepted
    assert.deepEqual(await codec.verify(later, ctx), { a: 2 });
    now -= 1; // 60.001 s behind: minted in the future
    await rejects(codec.verify(later, ctx), 'future');
  });

  test('a bind mismatch is refused, on either side', async () => {
    const bound = createSidecarRequestStateCodec({
      sidecar: sidecar.url,
      secret,
      audience: 'orders',
      bind: (c) => c.http?.req?.headers.get('x-user') ?? ''
    });
    const token = await bound.mint({ a: 1 }, withUser('alice'));
    assert.deepEqual(await bound.verify(token, withUser('alice')), { a: 1 });
    await rejects(bound.verify(token, withUser('bob')), 'bind');
    const unbound = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret, audience: 'orders' });
    await rejects(unbound.verify(token, ctx), 'bind');
    await rejects(bound.verify(await unbound.mint({ a: 1 }), withUser('alice')), 'bind');
    await assert.rejects(bound.mint({ a: 1 }), TypeError);
    const throwing = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret, audience: 'orders', bind: () => { throw new Error('x'); } });
    await rejects(throwing.verify(token, ctx), 'bind');
  });

  test("a token of the SDK's own createRequestStateCodec is rejected", async () => {
    const hmac = createRequestStateCodec({ key: 'k'.repeat(32) });
    const codec = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret, audience: 'orders' });
    await rejects(codec.verify(await hmac.mint({ a: 1 }), ctx), 'rejected');
  });

  test('malformed input never reaches the sidecar', async () => {
    const codec = createSidecarRequestStateCodec({ sidecar: 'unix:///nonexistent/sidecar.sock', secret, audience: 'orders' });
    for (const bad of ['', 'x'.repeat(4 * 1024 * 1024 + 1), 'a\ud800b', 42 as unknown as string]) {
      await rejects(codec.verify(bad, ctx), 'malformed');
    }
  });

  test('reasons never carry the payload or the secret', async () => {
    const codec = createSidecarRequestStateCodec({ sidecar: sidecar.url, secret, audience: 'orders' });
    const token = await codec.mint({ hidden: 'payload-text' });
    for (const bad of [token.slice(0, -2), token + 'A']) {
      await assert.rejects(codec.verify(bad, ctx), (e: Error) => !e.message.includes('payload-text') && !e.message.includes(secret) && !String(e.stack).includes(secret));
    }
  });
});

describe('a sidecar that is not there, or silent', () => {
  test('a missing socket is sidecar_unavailable, at once', async () => {
    const codec = createSidecarRequestStateCodec({ sidecar: 'unix:///nonexistent/sidecar.sock', secret, audience: 'orders' });
    await rejects(codec.mint({ a: 1 }), 'sidecar_unavailable');
    await rejects(codec.verify('mk1.AAAA', ctx), 'sidecar_unavailable');
  });

  test('a sidecar that accepts and never answers is sidecar_timeout within timeoutMs', async () => {
    const held: Socket[] = [];
    const silent: Server = createServer((s) => held.push(s));
    const path = join(mkdtempSync(join(tmpdir(), 'mrtr-silent-')), 's.sock');
    await new Promise<void>((r) => silent.listen(path, r));
    try {
      const codec = createSidecarRequestStateCodec({ sidecar: `unix://${path}`, secret, audience: 'orders', timeoutMs: 300 });
      const t0 = Date.now();
      await rejects(codec.verify('mk1.AAAA', ctx), 'sidecar_timeout');
      await rejects(codec.mint({ a: 1 }), 'sidecar_timeout');
      const took = Date.now() - t0;
      assert.ok(took >= 550 && took < 3_000, `took ${took} ms`);
      codec.close();
    } finally {
      held.forEach((s) => s.destroy());
      silent.close();
    }
  });
});

describe('options', () => {
  test('bad options are one clear SidecarConfigError that never shows the secret', () => {
    const base = { sidecar: 'http://127.0.0.1:8750', secret: 'mks_s3cret', audience: 'orders' };
    const cases: Record<string, unknown>[] = [
      { ...base, audience: '' },
      { ...base, sidecar: 'ftp://x' },
      { ...base, sidecar: 'unix://relative/path' },
      { ...base, sidecar: 'not a url' },
      { ...base, secret: 'with space' },
      { ...base, secret: '' },
      { ...base, ttlSeconds: 0 },
      { ...base, ttlSeconds: Number.NaN },
      { ...base, timeoutMs: -1 },
      { ...base, bind: 'x' }
    ];
    for (const options of cases) {
      assert.throws(
        () => createSidecarRequestStateCodec(options as never),
        (e: unknown) => e instanceof SidecarConfigError && !e.message.includes('s3cret'),
        JSON.stringify(options)
      );
    }
    delete process.env.MRTR_KEYS_SIDECAR_SECRET;
    assert.throws(() => createSidecarRequestStateCodec({ sidecar: base.sidecar, audience: 'orders' }), /MRTR_KEYS_SIDECAR_SECRET/);
    delete process.env.MRTR_KEYS_SIDECAR_URL;
    assert.throws(() => createSidecarRequestStateCodec({ secret: base.secret, audience: 'orders' }), /MRTR_KEYS_SIDECAR_URL/);
  });

  test('the URL shown never carries a password', () => {
    const codec = createSidecarRequestStateCodec({ sidecar: 'http://user:pw@127.0.0.1:8750', secret: 'mks_x', audience: 'orders' });
    assert.equal(codec.sidecar, 'http://127.0.0.1:8750/');
  });

  test('a payload that is not JSON is a TypeError before any request', async () => {
    const codec = createSidecarRequestStateCodec({ sidecar: 'unix:///nonexistent/s.sock', secret: 'mks_x', audience: 'orders' });
    for (const bad of [undefined, () => 1, 1n]) await assert.rejects(codec.mint(bad), TypeError);
    const cycle: Record<string, unknown> = {};
    cycle.self = cycle;
    await assert.rejects(codec.mint(cycle), TypeError);
  });
});
