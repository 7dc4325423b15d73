"""An example MCP server whose tool asks a question through `InputRequiredResult`, sealed by mrtr-keys.

    python -m mrtr_keys.example --keystore .mrtr/keyring.json --audience provisioner --port 8000
    python -m mrtr_keys.example.client http://127.0.0.1:8000/mcp --name orders --region eu-west-1

`build_server(security)` gives the `MCPServer` (tool `provision`); `__main__` picks the
`RequestStateSecurity` (by default ``mrtr_keys.request_state_security(keystore, audience=...)``, which opens
the codec the key ring records) and serves it over streamable HTTP with uvicorn. See docs/quickstart.md.
"""

from __future__ import annotations

from mrtr_keys.example.app import ASK_REGION, DEFAULT_NAME, QUESTION_KEY, QUESTION_STATE, TOOL_NAME, build_server

__all__ = ["ASK_REGION", "DEFAULT_NAME", "QUESTION_KEY", "QUESTION_STATE", "TOOL_NAME", "build_server"]
