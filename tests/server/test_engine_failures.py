"""The server when the engine fails, in process on a tiny random model: a request the engine
fails gets a 500 (the others go on); an engine that cannot go on turns /health 503, fails every
request with 503 at once and calls on_engine_dead, which `hyperserve serve` turns into exit 1."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from hyperserve.engine.engine import LLMEngine
from hyperserve.server.app import build_app
from hyperserve.server.settings import ServerSettings
from tests.conftest import tiny_config
from tests.server.conftest import serve_in_process

BODY = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def engine(save_hf_model):
    _, path = save_hf_model(tiny_config("llama"))
    return LLMEngine.from_kwargs(model=path, num_kv_blocks=64, block_size=4, max_model_len=128, dtype="float32")


def serve(engine: LLMEngine, dead: list | None = None) -> TestClient:
    app = build_app(lambda: engine, ServerSettings(model_name="tiny"),
                    on_engine_dead=(dead.append if dead is not None else None))
    return serve_in_process(app)


def break_runner(engine: LLMEngine, error: BaseException, when=lambda out: True) -> None:
    execute = engine.runner.execute

    def faulty(out, kv_cache):
        if when(out):
            raise error
        return execute(out, kv_cache)

    engine.runner.execute = faulty


def test_a_request_the_engine_fails_gets_a_500_and_the_next_is_served(engine):
    client = serve(engine)
    try:
        break_runner(engine, RuntimeError("bad kernel"), when=lambda out: any(r.prompt_token_ids == [9, 9, 9]
                                                                             for r in out.requests))
        failed = client.post("/v1/completions", json={**BODY, "prompt": [9, 9, 9]})
        assert failed.status_code == 500 and "bad kernel" in failed.json()["error"]["message"]
        streamed = client.post("/v1/completions", json={**BODY, "prompt": [9, 9, 9], "stream": True})
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["type"] == "server_error"
        assert client.post("/v1/completions", json=BODY).status_code == 200
        assert client.get("/health").status_code == 200
        assert engine.kv_cache.num_free_blocks == 64
    finally:
        client.__exit__(None, None, None)


@pytest.mark.parametrize("error", [MemoryError("host memory"), KeyboardInterrupt()])
def test_a_dead_engine_fails_every_request_fast_and_says_so(engine, error):
    dead: list = []
    client = serve(engine, dead)
    try:
        gate = threading.Event()
        execute = engine.runner.execute

        def stalled_then_broken(out, kv_cache):  # the first step waits, so a second request queues
            gate.wait(10)
            raise error

        engine.runner.execute = stalled_then_broken
        results = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, client.post("/v1/completions", json={**BODY, "stream": i == 1}))) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        gate.set()
        for t in threads:
            t.join(30)
        assert results[0].status_code == 503 and results[0].headers["retry-after"]
        assert "engine stopped" in results[0].json()["error"]["message"]
        assert '"service_unavailable"' in results[1].text  # the stream ends with the error event
        assert client.get("/health").status_code == 503
        started = time.perf_counter()
        assert client.post("/v1/completions", json=BODY).status_code == 503
        assert time.perf_counter() - started < 2
        assert len(dead) == 1
        engine.runner.execute = execute
    finally:
        client.__exit__(None, None, None)


def test_the_engine_is_built_and_stepped_on_one_thread(engine):
    """GNU OpenMP stops spin-waiting once its per-thread pools outnumber the cores: building the
    model on one thread and stepping it on another doubled the time per token (BENCHMARKS.md)."""
    threads = []

    def load():
        threads.append(threading.current_thread().name)
        return engine

    execute = engine.runner.execute

    def recorded(out, kv_cache):
        threads.append(threading.current_thread().name)
        return execute(out, kv_cache)

    engine.runner.execute = recorded
    app = build_app(load, ServerSettings(model_name="tiny"))
    with TestClient(app) as client:
        deadline = time.time() + 30
        while client.get("/health").status_code != 200:
            assert time.time() < deadline
            time.sleep(0.05)
        assert client.post("/v1/completions", json=BODY).status_code == 200
    assert set(threads) == {"hyperserve-engine"}
