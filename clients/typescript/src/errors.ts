/**
 * The one error type of this package, and its fixed reason codes.
 *
 * A `verify` failure rejects with a {@link RequestStateError} whose `message` is the bare reason code
 * (as the SDK's own `createRequestStateCodec` does: `'malformed'`, `'expired'`, `'bind'`, ...). The SDK
 * hands that message to the server's `onerror` as
 * `requestState verification rejected tools/call: <reason>` and answers the client with its frozen
 * `-32602` "Invalid or expired requestState"; nothing else reaches the wire. A reason never carries the
 * payload, the bind value, the token or the client secret.
 */

/** Why `verify` refused a `requestState`, or why `mint` could not seal one. */
export type RequestStateReason =
  /** Not a string, empty, or over the 4 MiB token cap; or the sealed envelope is not ours. */
  | 'malformed'
  /** The sidecar refused the token (HTTP 400): tampered, another audience, retired key, replayed. */
  | 'rejected'
  /** `exp` has passed. */
  | 'expired'
  /** `iat` is more than 60 s in the future (the Python SDK's `_FUTURE_SKEW`). */
  | 'future'
  /** The `bind(ctx)` value differs from the one at mint time (or only one side had one). */
  | 'bind'
  /** The sidecar refused this client's secret (HTTP 401). */
  | 'unauthorized'
  /** The client is not granted this audience or operation (HTTP 403). */
  | 'forbidden'
  /** `mint`: the payload is over the sidecar's size limit (HTTP 413). */
  | 'too_large'
  /** `mint`: the sidecar refused the request as invalid (HTTP 422). */
  | 'invalid_request'
  /** No connection, connection reset, or HTTP 503 (the ring's backend or the replay store is down). */
  | 'sidecar_unavailable'
  /** No complete answer within `timeoutMs`. */
  | 'sidecar_timeout'
  /** Any other answer: an unexpected status or a body that is not the documented JSON. */
  | 'sidecar_error';

/** Every reason code, for exhaustive handling and tests. */
export const REASONS: readonly RequestStateReason[] = [
  'malformed',
  'rejected',
  'expired',
  'future',
  'bind',
  'unauthorized',
  'forbidden',
  'too_large',
  'invalid_request',
  'sidecar_unavailable',
  'sidecar_timeout',
  'sidecar_error'
];

/** A `mint` or `verify` failure; `message` and `reason` are the same fixed code. */
export class RequestStateError extends Error {
  readonly reason: RequestStateReason;

  constructor(reason: RequestStateReason) {
    super(reason);
    this.name = 'RequestStateError';
    this.reason = reason;
  }
}

/** A bad option or environment variable, thrown by `createSidecarRequestStateCodec` (never names a secret). */
export class SidecarConfigError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'SidecarConfigError';
  }
}
