/**
 * The sidecar's HTTP API as this package uses it: `POST /v1/seal`, `POST /v1/unseal`, `GET /v1/keys`
 * (docs/sidecar.md), over `node:http` with one keep-alive connection pool.
 *
 * Why `node:http` and not `fetch`: Node's global `fetch` cannot reach a Unix socket without importing
 * the separate `undici` package, and an `http.Agent` with `socketPath` serves `http://` and
 * `unix:///path` alike with no dependency.
 *
 * Connections: kept alive and reused; an idle one is dropped after {@link IDLE_SOCKET_MS} (below the
 * sidecar's 8 s `keep_alive_timeout`, so the sidecar never closes a connection this side is about to
 * reuse). If a *reused* connection is reset before any answer arrives (the server closed it as the
 * request left), the request is sent once more on a new connection; nothing else is retried.
 */

import http from 'node:http';
import https from 'node:https';

import { RequestStateError, SidecarConfigError } from './errors.js';

/** An idle kept-alive connection is closed after this long (ms). The sidecar closes its side after 8 s. */
export const IDLE_SOCKET_MS = 5_000;
/** The longest answer read from the sidecar (bytes): a payload at the 4 MiB token cap plus its JSON. */
export const MAX_ANSWER_BYTES = 6 * 1024 * 1024;
/** Longest secret the sidecar accepts in `Authorization: Bearer` (bytes, `mrtr_keys.service.auth`). */
export const MAX_SECRET_CHARS = 512;

/** Where the sidecar listens: parsed from `http://HOST:PORT`, `https://HOST:PORT` or `unix:///PATH`. */
export interface SidecarTarget {
  /** The URL with any userinfo removed, safe to print. */
  readonly display: string;
  readonly secure: boolean;
  readonly host: string;
  readonly port?: number;
  readonly socketPath?: string;
  /** Path prefix of an http(s) URL (usually empty). */
  readonly prefix: string;
}

/**
 * Parse a sidecar URL.
 *
 * @throws SidecarConfigError an unsupported scheme, a relative or empty Unix socket path, no host.
 */
export function parseSidecarUrl(url: string): SidecarTarget {
  if (typeof url !== 'string' || url === '') {
    throw new SidecarConfigError('the sidecar URL is empty (sidecar: ... or MRTR_KEYS_SIDECAR_URL)');
  }
  let parsed: URL;
  try {
    parsed = new URL(url);
  } catch {
    throw new SidecarConfigError('the sidecar URL is not a URL (use http://HOST:PORT or unix:///PATH)');
  }
  const display = redact(parsed);
  if (parsed.protocol === 'unix:') {
    const socketPath = decodeURIComponent(parsed.pathname);
    if (parsed.host !== '' || !socketPath.startsWith('/') || socketPath === '/') {
      throw new SidecarConfigError('a Unix socket URL is unix:///absolute/path/to/sidecar.sock');
    }
    return { display, secure: false, host: 'sidecar', socketPath, prefix: '' };
  }
  if ((parsed.protocol === 'http:' || parsed.protocol === 'https:') && parsed.hostname !== '') {
    const secure = parsed.protocol === 'https:';
    const port = parsed.port === '' ? (secure ? 443 : 80) : Number(parsed.port);
    const host = parsed.hostname.replace(/^\[(.*)\]$/, '$1');
    return { display, secure, host, port, prefix: parsed.pathname.replace(/\/+$/, '') };
  }
  throw new SidecarConfigError(`unsupported sidecar URL ${display} (use http://HOST:PORT or unix:///PATH)`);
}

function redact(url: URL): string {
  const copy = new URL(url.href);
  copy.username = '';
  copy.password = '';
  copy.search = '';
  copy.hash = '';
  return copy.href;
}

/** A sidecar answer: its status and its JSON body (`undefined` when the body is not a JSON object). */
export interface Answer {
  readonly status: number;
  readonly body: Record<string, unknown> | undefined;
}

class Timeout extends Error {}

/** One keep-alive HTTP client of one sidecar, authenticated with one client secret. */
export class SidecarHttp {
  readonly target: SidecarTarget;
  private readonly agent: http.Agent;
  private readonly authorization: string;
  private readonly timeoutMs: number;

  constructor(target: SidecarTarget, secret: string, timeoutMs: number) {
    this.target = target;
    this.timeoutMs = timeoutMs;
    this.authorization = `Bearer ${secret}`;
    const options: http.AgentOptions = { keepAlive: true, timeout: IDLE_SOCKET_MS, scheduling: 'lifo' };
    this.agent = target.secure ? new https.Agent(options) : new http.Agent(options);
  }

  /**
   * `POST path` with a JSON body, answered within `timeoutMs` for the whole exchange.
   *
   * @throws RequestStateError `sidecar_unavailable` (no connection, reset), `sidecar_timeout`,
   *         `sidecar_error` (an answer over {@link MAX_ANSWER_BYTES}).
   */
  async post(path: string, body: unknown): Promise<Answer> {
    return this.send('POST', path, Buffer.from(JSON.stringify(body), 'utf8'));
  }

  /** `GET path`, as {@link post}. */
  async get(path: string): Promise<Answer> {
    return this.send('GET', path, undefined);
  }

  /** Close every pooled connection; later calls open new ones. */
  close(): void {
    this.agent.destroy();
  }

  private async send(method: string, path: string, body: Buffer | undefined): Promise<Answer> {
    const deadline = Date.now() + this.timeoutMs;
    for (let attempt = 0; ; attempt++) {
      try {
        return await this.once(method, path, body, deadline);
      } catch (error) {
        if (error instanceof Timeout || Date.now() >= deadline) {
          throw new RequestStateError('sidecar_timeout');
        }
        if (error instanceof RequestStateError) throw error;
        // A kept-alive connection the sidecar closed just as we reused it: once more, on a new one.
        if (attempt === 0 && (error as { reusedSocket?: boolean }).reusedSocket === true) continue;
        throw new RequestStateError('sidecar_unavailable');
      }
    }
  }

  private once(method: string, path: string, body: Buffer | undefined, deadline: number): Promise<Answer> {
    const t = this.target;
    const headers: http.OutgoingHttpHeaders = { authorization: this.authorization, accept: 'application/json' };
    if (body !== undefined) {
      headers['content-type'] = 'application/json';
      headers['content-length'] = body.length;
    }
    const options: http.RequestOptions = {
      method,
      path: t.prefix + path,
      headers,
      agent: this.agent,
      ...(t.socketPath !== undefined ? { socketPath: t.socketPath } : { host: t.host, port: t.port })
    };
    const request = t.secure ? https.request : http.request;
    return new Promise<Answer>((resolve, reject) => {
      let settled = false;
      let responded = false;
      const req = request(options);
      const timer = setTimeout(() => {
        fail(new Timeout());
        req.destroy();
      }, Math.max(0, deadline - Date.now()));
      const fail = (error: Error): void => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        if (req.reusedSocket && !responded && !(error instanceof Timeout)) Object.assign(error, { reusedSocket: true });
        reject(error);
      };
      req.on('error', fail);
      req.on('response', (res) => {
        responded = true;
        const chunks: Buffer[] = [];
        let size = 0;
        res.on('data', (chunk: Buffer) => {
          size += chunk.length;
          if (size > MAX_ANSWER_BYTES) {
            fail(new RequestStateError('sidecar_error'));
            req.destroy();
            return;
          }
          chunks.push(chunk);
        });
        res.on('error', fail);
        res.on('aborted', () => fail(new Error('aborted')));
        res.on('end', () => {
          if (settled) return;
          settled = true;
          clearTimeout(timer);
          resolve({ status: res.statusCode ?? 0, body: parseObject(Buffer.concat(chunks)) });
        });
      });
      req.end(body);
    });
  }
}

function parseObject(raw: Buffer): Record<string, unknown> | undefined {
  try {
    const doc: unknown = JSON.parse(raw.toString('utf8'));
    return typeof doc === 'object' && doc !== null && !Array.isArray(doc) ? (doc as Record<string, unknown>) : undefined;
  } catch {
    return undefined;
  }
}
