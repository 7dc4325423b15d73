/**
 * `createSidecarRequestStateCodec`: the SDK's `RequestStateCodec<T>` over the mrtr-keys sealing sidecar.
 */

import type { RequestStateCodec, ServerContext } from '@modelcontextprotocol/server';

import { RequestStateError, SidecarConfigError } from './errors.js';
import { bindTag, checkTimes, decodeEnvelope, encodeEnvelope, MAX_TOKEN_CHARS, sameTag } from './envelope.js';
import { MAX_SECRET_CHARS, parseSidecarUrl, SidecarHttp, type Answer } from './sidecar.js';

/** The sidecar URL when `sidecar` is not given (as the Python side's `health` and docs use it). */
export const ENV_SIDECAR_URL = 'MRTR_KEYS_SIDECAR_URL';
/** The client secret when `secret` is not given (as the Python `SidecarCodec` reads it). */
export const ENV_SIDECAR_SECRET = 'MRTR_KEYS_SIDECAR_SECRET';
/** Default lifetime of a minted `requestState` (seconds): the SDK's and the key ring's default TTL. */
export const DEFAULT_TTL_SECONDS = 600;
/** Default deadline of one sidecar request, connect to last byte (ms): the Python `SidecarCodec`'s 2 s. */
export const DEFAULT_TIMEOUT_MS = 2_000;

/** Options of {@link createSidecarRequestStateCodec}. */
export interface SidecarRequestStateCodecOptions {
  /**
   * The sidecar: `http://127.0.0.1:8750` (loopback or a pod-local address) or
   * `unix:///run/mrtr/sidecar.sock`. Default: `MRTR_KEYS_SIDECAR_URL`.
   */
  sidecar?: string;
  /**
   * This server's client secret, as printed once by `mrtr-keys clients add NAME --audience AUDIENCE`.
   * Default: `MRTR_KEYS_SIDECAR_SECRET`.
   */
  secret?: string;
  /**
   * The audience tokens are sealed for (usually the server's name); the client must be granted it.
   * A token sealed for another audience is refused (`'rejected'`).
   */
  audience: string;
  /**
   * How long a minted `requestState` stays valid (seconds, > 0; default 600). Keep it at most the key
   * ring's TTL (`mrtr-keys inspect`), which the rotation gates wait for; {@link SidecarRequestStateCodec.check}
   * verifies that.
   */
  ttlSeconds?: number;
  /**
   * Optional context binding, as in the SDK's codec: called at mint and at verify; a state minted under
   * one value is refused (`'bind'`) under another. Only a SHA-256 of the value is sealed (encrypted).
   * When set, `mint` requires its `ctx`.
   */
  bind?: (ctx: ServerContext) => string;
  /** Deadline of each sidecar request, connect to last byte (ms, > 0; default 2000). */
  timeoutMs?: number;
  /** The current time in ms since the epoch (default `Date.now`): for tests and custom time sources. */
  clock?: () => number;
}

/** What `GET /v1/keys` tells about the sidecar's key ring (never key material). */
export interface SidecarRing {
  /** The ring's TTL in seconds (the rotation gates wait for it). */
  ttlSeconds: number | undefined;
  /** The ring generation the sidecar serves. */
  generation: number | undefined;
  /** The whole answer of `GET /v1/keys`. */
  keys: Record<string, unknown>;
}

/** The codec: the SDK's `RequestStateCodec<T>` plus a start-up check and `close`. */
export interface SidecarRequestStateCodec<T = unknown> extends RequestStateCodec<T> {
  /**
   * Seal `payload` (any JSON value) through `POST /v1/seal`; returns the token for
   * `inputRequired({ requestState })`. Bound: can be passed around detached.
   *
   * @throws TypeError the payload is not JSON-serializable; `ctx` missing while `bind` is set.
   * @throws RangeError the payload is too large for a token.
   * @throws RequestStateError the sidecar could not seal (reason code; see {@link RequestStateReason}).
   */
  mint(payload: T, ctx?: ServerContext): Promise<string>;
  /**
   * Open an echoed `requestState` through `POST /v1/unseal`, check `iat`/`exp` and the bind value, and
   * return the payload. Bound: pass it as `ServerOptions.requestState.verify`.
   *
   * @throws RequestStateError on every failure, with a fixed reason code (fail closed).
   */
  verify(state: string, ctx: ServerContext): Promise<T>;
  /**
   * `GET /v1/keys`: check now that the sidecar accepts this secret and that `ttlSeconds` is at most the
   * ring's TTL, instead of on a user's first call. Resolves with what the sidecar reported.
   *
   * @throws SidecarConfigError the secret is refused, or `ttlSeconds` is longer than the ring's TTL.
   * @throws RequestStateError the sidecar cannot be reached (`sidecar_unavailable`, `sidecar_timeout`).
   */
  check(): Promise<SidecarRing>;
  /** Close the pooled keep-alive connections (idle ones never keep the process alive anyway). */
  close(): void;
  /** The audience tokens are sealed for. */
  readonly audience: string;
  /** The sidecar URL, without any userinfo. */
  readonly sidecar: string;
}

/**
 * A `RequestStateCodec<T>` for the TypeScript MCP SDK (`@modelcontextprotocol/server` 2.4) whose tokens
 * are sealed by the mrtr-keys sidecar: encrypted (AES-256-GCM, or the ring's codec), key-rotated without
 * a restart, audited per client, optionally single-use; the server holds no key material.
 *
 * ```ts
 * const codec = createSidecarRequestStateCodec<State>({ audience: 'orders' });
 * const server = new McpServer(info, { requestState: { verify: codec.verify } });
 * // in a tool: return inputRequired({ inputRequests, requestState: await codec.mint(state) });
 * ```
 *
 * @throws SidecarConfigError no or an unsupported sidecar URL, no or an unusable secret, an empty
 *         audience, a non-positive `ttlSeconds` or `timeoutMs`, a `bind` that is not a function.
 */
export function createSidecarRequestStateCodec<T = unknown>(
  options: SidecarRequestStateCodecOptions
): SidecarRequestStateCodec<T> {
  if (typeof options !== 'object' || options === null) {
    throw new SidecarConfigError('createSidecarRequestStateCodec needs an options object');
  }
  const { audience, bind } = options;
  if (typeof audience !== 'string' || audience === '') {
    throw new SidecarConfigError("the codec needs a non-empty audience (usually the MCP server's name)");
  }
  const url = options.sidecar ?? process.env[ENV_SIDECAR_URL];
  if (url === undefined || url === '') {
    throw new SidecarConfigError(`the codec needs the sidecar URL (sidecar: ... or ${ENV_SIDECAR_URL})`);
  }
  const secret = options.secret ?? process.env[ENV_SIDECAR_SECRET];
  if (typeof secret !== 'string' || !/^[\x21-\x7e]+$/.test(secret) || secret.length > MAX_SECRET_CHARS) {
    throw new SidecarConfigError(
      `the codec needs this server's client secret (secret: ... or ${ENV_SIDECAR_SECRET}), printable ASCII ` +
        `without spaces; issue one with: mrtr-keys clients add NAME --audience ${audience}`
    );
  }
  const ttlSeconds = options.ttlSeconds ?? DEFAULT_TTL_SECONDS;
  if (typeof ttlSeconds !== 'number' || !Number.isFinite(ttlSeconds) || ttlSeconds <= 0) {
    throw new SidecarConfigError('ttlSeconds must be a positive, finite number of seconds');
  }
  const timeoutMs = options.timeoutMs ?? DEFAULT_TIMEOUT_MS;
  if (typeof timeoutMs !== 'number' || !Number.isFinite(timeoutMs) || timeoutMs <= 0) {
    throw new SidecarConfigError('timeoutMs must be a positive, finite number of milliseconds');
  }
  if (bind !== undefined && typeof bind !== 'function') {
    throw new SidecarConfigError('bind must be a function (ctx) => string');
  }
  const clock = options.clock ?? Date.now;
  const http = new SidecarHttp(parseSidecarUrl(url), secret, timeoutMs);

  const tagOf = (ctx: ServerContext | undefined, failure: () => never): string | undefined => {
    if (bind === undefined) return undefined;
    let value: unknown;
    try {
      value = bind(ctx as ServerContext);
    } catch {
      failure();
    }
    if (typeof value !== 'string') failure();
    return bindTag(value);
  };

  const mint = async (payload: T, ctx?: ServerContext): Promise<string> => {
    if (bind !== undefined && ctx === undefined) {
      throw new TypeError('mint() requires ctx when a bind callback is configured');
    }
    const tag = tagOf(ctx, () => {
      throw new TypeError('the bind callback failed or did not return a string');
    });
    const now = clock() / 1000;
    const bytes = encodeEnvelope(payload, now, now + ttlSeconds, tag);
    const answer = await http.post('/v1/seal', { audience, payload: bytes.toString('base64url') });
    const token = answer.body?.token;
    if (answer.status === 200 && typeof token === 'string' && token !== '') return token;
    throw new RequestStateError(sealFailure(answer));
  };

  const verify = async (state: string, ctx: ServerContext): Promise<T> => {
    if (typeof state !== 'string' || state === '' || state.length > MAX_TOKEN_CHARS) {
      throw new RequestStateError('malformed');
    }
    if (!state.isWellFormed()) throw new RequestStateError('malformed'); // a lone surrogate is no token
    const answer = await http.post('/v1/unseal', { audience, token: state });
    const sealed = answer.body?.payload;
    if (answer.status !== 200 || typeof sealed !== 'string') throw new RequestStateError(unsealFailure(answer));
    const envelope = decodeEnvelope(Buffer.from(sealed, 'base64url'));
    checkTimes(envelope, clock() / 1000);
    const expected = tagOf(ctx, () => {
      throw new RequestStateError('bind');
    });
    if (!sameTag(envelope.b, expected)) throw new RequestStateError('bind');
    return envelope.p as T;
  };

  const check = async (): Promise<SidecarRing> => {
    const answer = await http.get('/v1/keys');
    if (answer.status === 401) {
      throw new SidecarConfigError(`the sidecar ${http.target.display} refused this client's secret (401)`);
    }
    if (answer.status !== 200 || answer.body === undefined) throw new RequestStateError(unsealFailure(answer));
    const keys = answer.body;
    const ringTtl = typeof keys.ttl_seconds === 'number' ? keys.ttl_seconds : undefined;
    const generation = typeof keys.generation === 'number' ? keys.generation : undefined;
    if (ringTtl !== undefined && ttlSeconds > ringTtl) {
      throw new SidecarConfigError(
        `ttlSeconds ${ttlSeconds} is longer than the key ring's TTL (${ringTtl} s), so a retire could ` +
          'reject rounds still in flight; raise the ring TTL with: mrtr-keys rotate begin --ttl SECONDS'
      );
    }
    return { ttlSeconds: ringTtl, generation, keys };
  };

  return {
    mint,
    verify,
    check,
    close: () => http.close(),
    audience,
    sidecar: http.target.display
  };
}

function transportFailure(answer: Answer): 'sidecar_unavailable' | 'sidecar_error' {
  return answer.status === 503 ? 'sidecar_unavailable' : 'sidecar_error';
}

function sealFailure(answer: Answer) {
  switch (answer.status) {
    case 401:
      return 'unauthorized' as const;
    case 403:
      return 'forbidden' as const;
    case 413:
      return 'too_large' as const;
    case 422:
      return 'invalid_request' as const;
    default:
      return transportFailure(answer);
  }
}

function unsealFailure(answer: Answer) {
  switch (answer.status) {
    case 200:
      return 'sidecar_error' as const; // 200 without a payload string: not the documented answer
    case 400:
    case 413:
    case 422:
      return 'rejected' as const;
    case 401:
      return 'unauthorized' as const;
    case 403:
      return 'forbidden' as const;
    default:
      return transportFailure(answer);
  }
}
