"""Faults a production deployment meets: a backend killed mid-stream behind the gateway."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from tests.gateway.conftest import running_stubs, start_gateway

pytestmark = pytest.mark.slow


@pytest.fixture
def slow_stubs():
    with running_stubs("a", "b") as started:
        for stub in started:
            stub.control(token_delay_s=0.2)
        yield started


def test_a_backend_killed_mid_stream_gives_a_clear_error_and_the_gateway_goes_on(slow_stubs, tmp_path):
    config = {"backends": [{"name": s.name, "url": s.url} for s in slow_stubs],
              "routes": [{"model": "m", "backends": ["a", "b"], "retries": 2, "backoff_s": 0.01}],
              "cache": {"enabled": False}, "breaker": {"failures": 1, "cooldown_s": 30}}
    words = " ".join(f"w{i}" for i in range(40))
    body = {"model": "m", "messages": [{"role": "user", "content": words}], "stream": True}
    with start_gateway(config, tmp_path) as gateway:
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as response:
            serving = next(s for s in slow_stubs if s.name == response.headers["x-hyperserve-backend"])
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            os.kill(serving.process.pid, signal.SIGKILL)  # kill -9, mid-stream
            rest = [line for line in lines if line.startswith("data: ")]
        assert json.loads(first[6:])["choices"][0]["delta"]["content"]
        assert rest[-1] == "data: [DONE]"  # the stream is closed properly, not cut
        error = json.loads(rest[-2][6:])["error"]
        assert error["type"] == "bad_gateway" and "stream broke" in error["message"]
        assert httpx.get(f"{gateway.url}/health").status_code == 200
        survivor = next(s for s in slow_stubs if s is not serving)
        survivor.control(token_delay_s=0.0)
        for _ in range(3):  # later requests complete on the survivor
            reply = gateway.chat("still there?")
            assert reply.status_code == 200 and reply.json()["model"] == survivor.name
