"""Every error class with its status and body; cancellation returns KV blocks; overload gets 429."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None, contains: str = ""):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert contains in error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": 12}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "max_tokens": 2, "min_tokens": 5}, None),
    ({"prompt": "x", "allowed_token_ids": [10**9]}, None),
    ({"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "x", "suffix": "y"}, None),
])
def test_invalid_parameters_get_400(server, body, param):
    assert_error(post(server, "/v1/completions", json=body), 400, param)


def test_chat_without_messages_gets_400(server):
    assert_error(post(server, "/v1/chat/completions", json={"messages": []}), 400, "messages")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/cache"])
def test_unsupported_content_parts_get_400(server, path):
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
    assert_error(post(server, path, json={"messages": [image]}), 400, "messages", contains="image_url")


def test_prompt_longer_than_the_context_gets_400_naming_the_limit(server):
    r = post(server, "/v1/completions", json={"prompt": "hello " * 9000, "max_tokens": 4})
    assert_error(r, 400, "prompt", contains="8192")
    r = post(server, "/v1/completions", json={"prompt": "hello", "max_tokens": 9000})
    assert_error(r, 400, "max_tokens", contains="8192")


def test_unknown_model_gets_404(server):
    assert_error(post(server, "/v1/completions", json={"model": "gpt-5", "prompt": "x"}), 404, "model")


def test_malformed_json_gets_400(server):
    r = post(server, "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400, contains="JSON")


def test_huge_body_gets_413(server):
    assert_error(post(server, "/v1/completions", json={"prompt": "x" * 200_000}), 413)


def test_sse_client_disconnect_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 6:
                break  # closes the connection mid-generation
    server.wait_idle()
    assert server.metric("kv_cache_usage_perc") == 0
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_websocket_streams_and_cancels(server):
    async def scenario():
        ws_url = server.url.replace("http", "ws") + "/v1/ws"
        async with websockets.connect(ws_url) as ws:
            await ws.send(json.dumps({"type": "completions", "request_id": "short",
                                      "body": {"prompt": "Hi", "max_tokens": 3, "temperature": 0}}))
            events = []
            while not events or events[-1]["type"] != "done":
                events.append(json.loads(await ws.recv()))
            assert all(e["request_id"] == "short" for e in events)
            assert "".join(e["data"]["choices"][0]["text"] for e in events[:-1] if e["data"]["choices"])

            await ws.send(json.dumps({"type": "chat.completions", "request_id": "long",
                                      "body": {"messages": [{"role": "user", "content": "Write an essay."}],
                                               "max_tokens": 500, "ignore_eos": True}}))
            chunks = 0
            while chunks < 5:
                if json.loads(await ws.recv())["type"] == "chunk":
                    chunks += 1
            await ws.send(json.dumps({"type": "cancel", "request_id": "long"}))
            while (event := json.loads(await ws.recv()))["type"] == "chunk":
                pass
            assert event["type"] == "cancelled"

            await ws.send(json.dumps({"type": "completions", "request_id": "bad", "body": {"prompt": "x", "top_p": 7}}))
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and error["error"]["param"] == "top_p"

            await ws.send(b"\xff\x00 not a message")  # a binary frame: an error event, and the socket stays open
            error = json.loads(await ws.recv())
            assert error["type"] == "error" and "JSON" in error["error"]["message"]
            await ws.send(json.dumps({"type": "completions", "request_id": "after",
                                      "body": {"prompt": "Hi", "max_tokens": 2}}).encode())  # JSON in binary is fine
            while (event := json.loads(await ws.recv()))["type"] == "chunk":
                pass
            assert event == {"type": "done", "request_id": "after"}

    asyncio.run(scenario())
    server.wait_idle()


def test_overload_gets_429_with_retry_after_and_nothing_leaks(server):
    """max_num_seqs=4 and max_queue=4: of 14 concurrent long requests some must be refused."""
    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            body = {"prompt": "Go on:", "max_tokens": 40, "ignore_eos": True}

            async def one():
                return await client.post("/v1/completions", json=body)

            return await asyncio.gather(*(one() for _ in range(14)))

    responses = asyncio.run(scenario())
    refused = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == 14
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in served)
    server.wait_idle()


def test_metrics_are_exported_with_vllm_names(server):
    assert post(server, "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "prompt_tokens_total", "generation_tokens_total",
                 "num_preemptions_total", "request_success_total", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prefix_cache_evictions_total"):
        assert f"hyperserve:{name}" in text
    assert server.metric("generation_tokens_total") > 0
    assert 0 < server.metric("kv_cache_touched_perc") <= 1  # the request's blocks were written


def test_server_timing_header(server):
    r = post(server, "/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    timing = r.headers["server-timing"]
    assert [part.split(";")[0] for part in timing.split(", ")] == ["queue", "prefill", "decode"]
