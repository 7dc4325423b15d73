/**
 * The envelope sealed inside every token: what `mint` hands the sidecar and `verify` gets back.
 *
 * ```text
 * JSON (UTF-8): {"v":1,"p":<payload>,"iat":<seconds>,"exp":<seconds>,"b":<bind tag>?}
 * ```
 *
 * - `v`: the envelope version, 1.
 * - `p`: the payload as given to `mint`, through `JSON.stringify` / `JSON.parse` (the same round trip
 *   as the SDK's `createRequestStateCodec`).
 * - `iat`, `exp`: POSIX seconds (fractions allowed) when it was minted and when it expires.
 * - `b`: with a `bind` callback, base64url(SHA-256(`"mrtr-keys.requestState.bind:"` + bind(ctx))), 43
 *   characters; absent otherwise. The value itself is never stored, and the whole envelope is encrypted
 *   by the sidecar, so the client sees neither.
 *
 * The sidecar then seals these bytes for the codec's audience (AES-256-GCM under the ring's primary key,
 * or whatever codec the ring records; docs/token-format.md), and the token it returns is the
 * `requestState` on the wire.
 */

import { createHash, timingSafeEqual } from 'node:crypto';

import { RequestStateError } from './errors.js';

export const ENVELOPE_VERSION = 1;
/**
 * How far in the future `iat` may be (seconds): the Python SDK's `_FUTURE_SKEW`
 * (`mcp/server/request_state.py`, mcp 2.3: accept iff `iat <= now + 60` and `now < exp`), so a token
 * minted on a host whose clock runs ahead is accepted by one whose clock is behind.
 */
export const FUTURE_SKEW_SECONDS = 60;
/**
 * Largest envelope the sidecar seals (bytes): the payload whose token is exactly the 4 MiB token cap
 * (`mrtr_keys.codecs.aesgcm.MAX_PAYLOAD_BYTES`).
 */
export const MAX_ENVELOPE_BYTES = 3_145_693;
/** Longest token `verify` sends to the sidecar (characters, `mrtr_keys.token.MAX_TOKEN_CHARS`). */
export const MAX_TOKEN_CHARS = 4 * 1024 * 1024;

const BIND_LABEL = 'mrtr-keys.requestState.bind:';

export interface Envelope {
  v: number;
  p: unknown;
  iat: number;
  exp: number;
  b?: string;
}

/** base64url(SHA-256(label + value)) of a bind value. */
export function bindTag(value: string): string {
  return createHash('sha256').update(BIND_LABEL + value, 'utf8').digest('base64url');
}

/** Constant-time comparison of two bind tags (either may be absent). */
export function sameTag(a: string | undefined, b: string | undefined): boolean {
  if (a === undefined || b === undefined) return a === b;
  const x = Buffer.from(a, 'utf8');
  const y = Buffer.from(b, 'utf8');
  return x.length === y.length && timingSafeEqual(x, y);
}

/**
 * The envelope's bytes for `payload`.
 *
 * @throws TypeError the payload is not JSON-serializable (undefined, a function, a BigInt, a cycle).
 * @throws RangeError the envelope is over {@link MAX_ENVELOPE_BYTES}.
 */
export function encodeEnvelope(payload: unknown, iat: number, exp: number, tag: string | undefined): Buffer {
  const kind = typeof payload;
  if (payload === undefined || kind === 'function' || kind === 'symbol' || kind === 'bigint') {
    throw new TypeError('requestState payload must be JSON-serializable');
  }
  const envelope: Envelope = { v: ENVELOPE_VERSION, p: payload, iat, exp };
  if (tag !== undefined) envelope.b = tag;
  let text: string;
  try {
    text = JSON.stringify(envelope);
  } catch {
    throw new TypeError('requestState payload must be JSON-serializable');
  }
  const bytes = Buffer.from(text, 'utf8');
  if (bytes.length > MAX_ENVELOPE_BYTES) {
    throw new RangeError(`requestState payload too large (its envelope is over ${MAX_ENVELOPE_BYTES} bytes)`);
  }
  return bytes;
}

/**
 * Parse envelope bytes the sidecar returned.
 *
 * @throws RequestStateError `malformed`: not UTF-8 JSON of the shape above.
 */
export function decodeEnvelope(bytes: Buffer): Envelope {
  let doc: unknown;
  try {
    doc = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes));
  } catch {
    throw new RequestStateError('malformed');
  }
  if (typeof doc !== 'object' || doc === null || Array.isArray(doc)) throw new RequestStateError('malformed');
  const e = doc as Record<string, unknown>;
  if (e.v !== ENVELOPE_VERSION || !('p' in e) || typeof e.iat !== 'number' || typeof e.exp !== 'number') {
    throw new RequestStateError('malformed');
  }
  if (e.b !== undefined && typeof e.b !== 'string') throw new RequestStateError('malformed');
  return e as unknown as Envelope;
}

/**
 * Check `iat` and `exp` against `nowSeconds`, stated positively so a NaN fails (as the Python SDK does).
 *
 * @throws RequestStateError `future` or `expired`.
 */
export function checkTimes(envelope: Envelope, nowSeconds: number): void {
  if (!(envelope.iat <= nowSeconds + FUTURE_SKEW_SECONDS)) throw new RequestStateError('future');
  if (!(nowSeconds < envelope.exp)) throw new RequestStateError('expired');
}
