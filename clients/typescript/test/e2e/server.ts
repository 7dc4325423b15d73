/**
 * The test server of the end-to-end tests (tests/typescript/): an `McpServer` with one tool, `provision`,
 * that asks for a region through `inputRequired` (elicitation) and keeps its question in `requestState`.
 *
 * Settings come from the environment:
 *   MRTR_TS_CODEC     `sidecar` (default: createSidecarRequestStateCodec, which reads
 *                     MRTR_KEYS_SIDECAR_URL and MRTR_KEYS_SIDECAR_SECRET) or `hmac` (the SDK's own
 *                     createRequestStateCodec with MRTR_TS_HMAC_KEY, the control)
 *   MRTR_TS_AUDIENCE  the audience (default `orders`)
 *   MRTR_TS_INSTANCE  a label added to the final text ("served by ...")
 *   MRTR_TS_TTL       ttlSeconds (default 600)
 *   MRTR_TS_BIND      a request header name whose value the state is bound to (default: no binding)
 *   MRTR_TS_PORT      the port on 127.0.0.1 (default 0: any free port)
 * It prints `listening PORT` on stdout once it accepts connections, and every `onerror` reason as
 * `onerror: MESSAGE` on stderr.
 */

import { createServer } from 'node:http';

import { toNodeHandler } from '@modelcontextprotocol/node';
import type { CallToolResult, InputRequiredResult, RequestStateCodec } from '@modelcontextprotocol/server';
import {
  acceptedContent,
  createMcpHandler,
  createRequestStateCodec,
  inputRequired,
  McpServer
} from '@modelcontextprotocol/server';
import * as z from 'zod/v4';

import { createSidecarRequestStateCodec } from '../../src/index.js';

const QUESTION = 'provision/region/v1';
type State = { q: string; name: string; note: string };

const env = process.env;
const audience = env.MRTR_TS_AUDIENCE ?? 'orders';
const instance = env.MRTR_TS_INSTANCE ?? '';
const ttlSeconds = Number(env.MRTR_TS_TTL ?? '600');
const bindHeader = env.MRTR_TS_BIND;
const bind = bindHeader ? (ctx: { http?: { req?: Request } }) => ctx.http?.req?.headers.get(bindHeader) ?? '' : undefined;

const codec: RequestStateCodec<State> =
  env.MRTR_TS_CODEC === 'hmac'
    ? createRequestStateCodec<State>({ key: env.MRTR_TS_HMAC_KEY ?? '', ttlSeconds, ...(bind ? { bind } : {}) })
    : createSidecarRequestStateCodec<State>({ audience, ttlSeconds, ...(bind ? { bind } : {}) });

const ASK_REGION = {
  message: 'Which region should the database live in?',
  requestedSchema: {
    type: 'object' as const,
    properties: { region: { type: 'string' as const } },
    required: ['region']
  }
};

function buildServer(): McpServer {
  const server = new McpServer(
    { name: audience, version: '1.0.0' },
    { capabilities: { tools: {} }, requestState: { verify: codec.verify } }
  );
  server.server.onerror = (error: Error) => console.error(`onerror: ${error.message}`);
  server.registerTool(
    'provision',
    { description: 'Provision a database; asks which region.', inputSchema: z.object({ name: z.string() }) },
    async ({ name }, ctx): Promise<CallToolResult | InputRequiredResult> => {
      const state = ctx.mcpReq.requestState<State>();
      const answer = acceptedContent<{ region: string }>(ctx.mcpReq.inputResponses, 'region');
      if (state?.q !== QUESTION || typeof answer?.region !== 'string' || answer.region === '') {
        const fresh: State = { q: QUESTION, name, note: `confidential note for ${name}` };
        return inputRequired({
          inputRequests: { region: inputRequired.elicit(ASK_REGION) },
          requestState: await codec.mint(fresh, ctx)
        });
      }
      const served = instance ? ` (served by ${instance})` : '';
      return { content: [{ type: 'text', text: `Provisioned '${state.name}' in ${answer.region}.${served}` }] };
    }
  );
  return server;
}

const handler = createMcpHandler(buildServer, { onerror: (error) => console.error(`onerror: ${error.message}`) });
const http = createServer(toNodeHandler(handler));
http.keepAliveTimeout = 5_000;
http.listen(Number(env.MRTR_TS_PORT ?? '0'), '127.0.0.1', () => {
  const address = http.address();
  console.log(`listening ${typeof address === 'object' && address !== null ? address.port : '?'}`);
});
for (const signal of ['SIGTERM', 'SIGINT'] as const) {
  process.on(signal, () => {
    http.close();
    http.closeAllConnections();
    process.exit(0);
  });
}
