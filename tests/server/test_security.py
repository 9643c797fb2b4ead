"""`hyperserve serve --api-key`: the same security layer in front of the engine's own server."""

import asyncio

import httpx
import pytest
import websockets

from tests.server.conftest import start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    config = tmp_path_factory.mktemp("keys") / "security.yaml"
    config.write_text("guardrails: {pii_request: redact, reversible_redaction: true}\n")
    server = start_server("--api-key", "s3cret", "--security-config", str(config), "--kv-cache-memory-gb", "0.5",
                          log_name="security")
    yield server
    stop_server(server)


def test_server_requires_the_key_and_answers_with_it(keyed_server):
    url = keyed_server.url
    body = {"messages": [{"role": "user", "content": "Say hi to bob@example.com"}], "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 401
    ok = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer s3cret"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_websocket_is_refused_without_the_key_and_when_guardrails_need_http(keyed_server):
    ws_url = keyed_server.url.replace("http", "ws") + "/v1/ws"

    async def handshake(headers):
        async with websockets.connect(ws_url, additional_headers=headers) as ws:
            await ws.recv()

    for headers in ({}, {"Authorization": "Bearer s3cret"}):
        with pytest.raises((websockets.InvalidStatus, websockets.ConnectionClosed)):
            asyncio.run(handshake(headers))
