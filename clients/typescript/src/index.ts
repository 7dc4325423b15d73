/**
 * mrtr-keys for TypeScript MCP servers: a `RequestStateCodec<T>` (`@modelcontextprotocol/server` 2.4)
 * whose `requestState` tokens are sealed by the mrtr-keys sidecar. See docs/typescript.md.
 */

export {
  createSidecarRequestStateCodec,
  DEFAULT_TIMEOUT_MS,
  DEFAULT_TTL_SECONDS,
  ENV_SIDECAR_SECRET,
  ENV_SIDECAR_URL,
  type SidecarRequestStateCodec,
  type SidecarRequestStateCodecOptions,
  type SidecarRing
} from './codec.js';
export { ENVELOPE_VERSION, FUTURE_SKEW_SECONDS, MAX_ENVELOPE_BYTES, MAX_TOKEN_CHARS } from './envelope.js';
export { REASONS, RequestStateError, SidecarConfigError, type RequestStateReason } from './errors.js';
export { IDLE_SOCKET_MS } from './sidecar.js';
