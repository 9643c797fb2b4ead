"""`hyperserve bench` against the stub backend, served in this process: what it counts and times,
for each endpoint, and what it reports when the server fails."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn

from hyperserve.bench.run import add_bench_args, make_requests, run_from_args
from hyperserve.common.anthropic_api import AnthropicAPI
from hyperserve.common.responses_api import ResponsesAPI
from tests.gateway.stub_backend import build_stub
from tests.server.conftest import free_port

TOKEN_DELAY_S = 0.02


@pytest.fixture
def stub():
    port = free_port()
    app = AnthropicAPI(ResponsesAPI(build_stub("stub")))  # /v1/responses and /v1/messages over its chat endpoint
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(timeout=10)


def bench(url: str, *flags: str) -> dict:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return run_from_args(parser.parse_args(["--base-url", url, "--num-requests", "4", "--concurrency", "2",
                                            "--input-tokens", "6", *flags]))


@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses", "messages"])
def test_streams_are_timed_token_by_token(stub, endpoint):
    httpx.post(f"{stub}/control", json={"token_delay_s": TOKEN_DELAY_S})
    summary = bench(stub + "/", "--endpoint", endpoint)  # a trailing slash on the base URL is fine
    assert summary["num_ok"] == 4 and summary["num_failed"] == 0
    # the stub answers "stub says: <prompt>": 2 + ~6 words, one token each, TOKEN_DELAY_S apart
    assert summary["output_token_throughput"] > 0
    assert summary["mean_prompt_tokens"] == 10  # from the stream's usage chunk
    assert summary["prompt_cache_hit_rate"] == 0.4  # 4 of them cached, in each API's own words
    assert summary["itl_p50_ms"] >= 0.9 * TOKEN_DELAY_S * 1000
    assert summary["itl_p50_ms"] < 20 * TOKEN_DELAY_S * 1000
    assert 0 < summary["ttft_p50_ms"] < summary["e2e_p50_ms"]


def test_a_failing_server_is_reported_per_request(stub):
    httpx.post(f"{stub}/control", json={"fail_status": 503})
    summary = bench(stub)
    assert summary["num_ok"] == 0 and summary["num_failed"] == 4
    assert summary["errors"] and summary["errors"][0].startswith("HTTP 503")


def test_without_model_it_asks_the_server_which_it_serves():
    """No --model: the first model of GET /v1/models (a server serving Gemma 3 alone answered every
    request of the default name with 404); a server that lists none gets the default name."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app, asked = FastAPI(), []

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "gemma3-270m", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        asked.append(body["model"])
        if body["model"] != "gemma3-270m":
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
        events = [{"choices": [{"text": " hi", "index": 0}]}, {"choices": [], "usage": {"prompt_tokens": 6,
                                                                                        "completion_tokens": 1}}]
        return StreamingResponse(iter([f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]),
                                 media_type="text/event-stream")

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        summary = bench(f"http://127.0.0.1:{port}")
        assert summary["num_ok"] == 4 and summary["model"] == "gemma3-270m" and set(asked) == {"gemma3-270m"}
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_an_unreachable_server_is_reported_not_raised():
    summary = bench(f"http://127.0.0.1:{free_port()}")
    assert summary["num_failed"] == 4 and "Connect" in summary["errors"][0]


def _read_request(connection: socket.socket) -> None:
    """Reads one HTTP request, its head and then as many body bytes as its content-length says."""
    data, length = b"", None
    while length is None or len(data) < length:
        received = connection.recv(65536)
        if not received:
            return
        data += received
        if length is None and b"\r\n\r\n" in data:
            head, data = data.split(b"\r\n\r\n", 1)
            length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))


class _DroppingServer:
    """Answers each request with a short stream, but drops every `drop_every`-th connection once
    its request is in, unanswered, as a server drops a kept-alive connection it had closed."""

    def __init__(self, drop_every: int) -> None:
        self.drop_every, self.connections = drop_every, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        stream = "".join(f'data: {{"choices": [{{"text": "t{i}"}}]}}\n\n' for i in range(3)) + "data: [DONE]\n\n"
        answer = ("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                  f"content-length: {len(stream)}\r\n\r\n{stream}").encode()
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            with connection:
                self.connections += 1
                _read_request(connection)  # all of it: closing on unread bytes would reset, not close
                if self.connections % self.drop_every:
                    connection.sendall(answer)

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone does not
        self.listener.close()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


def test_a_connection_dropped_before_any_answer_is_tried_again():
    """llama-server closes kept-alive connections after a few requests; the request that finds one
    closed is sent again on another connection. One that fails every try is reported."""
    server = _DroppingServer(drop_every=2)
    try:
        summary = bench(server.url, "--concurrency", "1", "--model", "any")  # no GET /v1/models to count
        assert summary["num_ok"] == 4 and summary["num_failed"] == 0
        assert server.connections == 7  # answered, then dropped and answered, three times
    finally:
        server.close()
    server = _DroppingServer(drop_every=1)
    try:
        summary = bench(server.url, "--num-requests", "1", "--model", "any")
        assert summary["num_failed"] == 1 and "Disconnected" in summary["errors"][0]
    finally:
        server.close()


def test_an_event_split_between_reads_is_timed_by_the_read_that_completes_it():
    from hyperserve.bench.run import RequestResult, _count

    result = RequestResult(ok=False)
    _count([(1.0, b'data: {"choices": [{"text": "a"}]}\r\n\r\ndata: {"choi'),
            (1.5, b'ces": [{"text": "b"}]}\n'),
            (2.5, b'\ndata: {"choices": [{"text": ""}]}\n\ndata: {"choices": [], "usage": '
                  b'{"prompt_tokens": 3, "completion_tokens": 2}}\n\ndata: [DONE]\n\n')], 0.5, result)
    assert result.chunks == 2 and result.ttft == 0.5 and result.itls == [0.5]
    assert (result.prompt_tokens, result.output_tokens) == (3, 2)


def test_the_client_starts_without_pytorch():
    """`hyperserve bench` runs beside the server it measures: it loads what it needs, not a model stack."""
    code = "import sys, hyperserve.bench.run; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_several_loads_make_a_sweep_and_runs_compare_side_by_side(stub, tmp_path):
    """--concurrency 1 3: requests of the same lengths at each load (their first words differ, so
    no load hits the prefix cache of another's), a summary each, one JSON and a curve; --compare
    then reads runs back (a sweep and a single load) for one table and plot."""
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args(["--num-requests", "8"])
    first, second = make_requests(args, 0), make_requests(args, 1)
    assert [len(a.prompt.split()) for a in first] == [len(b.prompt.split()) for b in second]
    assert not {a.prompt.split(":")[0] for a in first} & {b.prompt.split(":")[0] for b in second}
    common = ["--base-url", stub, "--num-requests", "3", "--input-tokens", "6"]
    sweep = run_from_args(parser.parse_args([*common, "--concurrency", "1", "3", "--output-json",
                                             str(tmp_path / "sweep.json"), "--plot", str(tmp_path / "sweep.png")]))
    assert [s["concurrency"] for s in sweep["sweep"]] == [1, 3]
    assert all(s["num_ok"] == 3 and s["mean_prompt_tokens"] == 10 for s in sweep["sweep"])
    assert json.loads((tmp_path / "sweep.json").read_text())["sweep"] == sweep["sweep"]
    single = run_from_args(parser.parse_args([*common, "--request-rate", "50", "--output-json",
                                              str(tmp_path / "single.json")]))
    assert single["request_rate"] == 50 and single["num_ok"] == 3
    files = [str(tmp_path / "sweep.json"), str(tmp_path / "single.json")]
    compared = run_from_args(parser.parse_args(["--compare", *files, "--plot", str(tmp_path / "compare.png")]))
    assert list(compared["runs"].values()) == [sweep["sweep"], [single]]
    assert list(compared["runs"])[1] == str(tmp_path / "single.json")  # the same server: named by its file
    for png in ("sweep.png", "compare.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
