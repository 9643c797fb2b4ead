"""SIGTERM lets a running request finish within the grace period."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import start_server, stop_server

pytestmark = pytest.mark.slow


def test_sigterm_lets_running_requests_finish():
    server = start_server("--kv-cache-memory-gb", "0.5", "--shutdown-grace-s", "60", log_name="shutdown")
    result = {}

    def request():
        body = {"prompt": "Count slowly:", "max_tokens": 60, "ignore_eos": True}
        result["response"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

    thread = threading.Thread(target=request)
    thread.start()
    try:
        time.sleep(1.0)  # the request is running
        server.process.send_signal(signal.SIGTERM)
        thread.join(timeout=120)
        assert result["response"].status_code == 200
        assert result["response"].json()["usage"]["completion_tokens"] == 60
        assert server.process.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal on exit
    finally:
        stop_server(server)  # gone already, unless an assertion failed first


def test_a_model_that_cannot_load_stops_the_server_with_an_error():
    with pytest.raises(RuntimeError, match="exited with 1"):
        start_server("--kv-cache-memory-gb", "0.1", log_name="badload")
