"""The web pages' server side without a browser: what is open, /stats, and a WebSocket key carried
as a subprotocol (tests/server/test_web_ui.py drives the pages themselves)."""

import pytest
from fastapi import FastAPI, WebSocket
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter
from starlette.websockets import WebSocketDisconnect

from hyperserve.common.web_ui import install_web_ui
from hyperserve.security.config import load_security_config
from hyperserve.security.middleware import Governor, add_security


@pytest.fixture
def client():
    registry = CollectorRegistry()
    Counter("hyperserve:generation_tokens", "Tokens generated", ["model_name"], registry=registry).labels("m").inc(7)
    app = FastAPI()
    add_security(app, Governor(load_security_config(None, "ui-secret")))

    @app.websocket("/v1/ws")
    async def echo(ws: WebSocket) -> None:
        await ws.accept(subprotocol="hyperserve")
        await ws.send_json({"type": "done", "cache_scope": ws.state.cache_scope})  # the key's, as over HTTP
        await ws.close()

    install_web_ui(app, registry, "server")
    with TestClient(app) as client:
        yield client


def test_the_pages_are_open_and_their_data_needs_the_key(client):
    assert client.get("/", follow_redirects=False).headers["location"] == "/ui/"
    page = client.get("/ui/")
    assert page.status_code == 200 and "playground.js" in page.text
    assert client.get("/ui/vendor/purify.es.mjs").status_code == 200
    assert client.get("/ui/kind.json").json() == {"kind": "server"}
    assert client.get("/stats").status_code == 401
    stats = client.get("/stats", headers={"Authorization": "Bearer ui-secret"}).json()
    assert stats["samples"]["hyperserve:generation_tokens_total"] == [{"labels": {"model_name": "m"}, "value": 7.0}]


def test_a_websocket_key_may_come_as_a_subprotocol(client):
    with client.websocket_connect("/v1/ws", subprotocols=["hyperserve", "bearer.ui-secret"]) as ws:
        assert ws.accepted_subprotocol == "hyperserve"
        assert ws.receive_json() == {"type": "done", "cache_scope": "key:default"}
    for protocols in (["hyperserve"], ["hyperserve", "bearer.wrong"]):
        with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect("/v1/ws", subprotocols=protocols):
            pass
        assert refused.value.code == 1008
