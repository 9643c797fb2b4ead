"""The same pages on the gateway, in a real browser: the playground streams over the gateway's
WebSocket and the dashboard shows cache outcomes and the backends' health."""

from __future__ import annotations

import json

import pytest

from tests.gateway.conftest import start_gateway
from tests.gateway.test_app import _config
from tests.server.test_web_ui import SCREENSHOTS, browser, playwright_api, send  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow


def test_the_gateway_playground_and_dashboard(stubs, tmp_path, browser):  # noqa: F811
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    with start_gateway(_config(stubs[:1], tmp_path), tmp_path) as gateway:
        try:
            page = context.new_page()
            frames = []  # what the page's sockets received
            page.on("websocket", lambda ws: ws.on("framereceived", lambda frame: frames.append(frame)))
            page.goto(gateway.url)
            page.wait_for_selector("#model option[value=m]", state="attached")
            answer = send(page, "What is the capital of France?")
            playwright_api.expect(answer.locator(".stats")).to_contain_text("TTFT", timeout=30_000)
            assert answer.locator(".content").inner_text().strip()
            assert any(json.loads(frame)["type"] == "chunk" for frame in frames)  # streamed over the socket
            page.goto(f"{gateway.url}/ui/dashboard.html")
            playwright_api.expect(page.locator("#backends tbody")).to_contain_text("up", timeout=10_000)
            for _ in range(3):  # a miss, then exact hits, while the page watches
                assert gateway.chat("Name a colour.").status_code == 200
            page.wait_for_function("document.querySelector(\"section.chart[aria-label='Requests/s by cache "
                                   "outcome']\").dataset.points > 0", timeout=20_000)
            page.wait_for_timeout(4000)  # a few seconds of history in the picture
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=SCREENSHOTS / "gateway-dashboard.png")
        finally:
            context.close()
