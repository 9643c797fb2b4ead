"""Hostile requests against a real server: each gets a 4xx with an OpenAI-style error body, and a
normal request is still answered after it. The first case is the one that used to kill the engine."""

from __future__ import annotations

import json

import httpx
import pytest
import websockets.sync.client

pytestmark = pytest.mark.slow

HUGE = 10**30
OK = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def completion(**fields):
    return "/v1/completions", {**OK, **fields}


def chat(**fields):
    return "/v1/chat/completions", {**CHAT, **fields}


def user(content):
    return chat(messages=[{"role": "user", "content": content}])


CASES = {
    # numbers out of range, of the wrong type, or not numbers at all
    "seed 2**64": completion(seed=2**64),
    "seed negative": completion(seed=-1),
    "seed float": completion(seed=1.5),
    "seed string": completion(seed="abc"),
    "max_tokens negative": completion(max_tokens=-1),
    "max_tokens zero": completion(max_tokens=0),
    "max_tokens huge": completion(max_tokens=HUGE),
    "max_tokens past context": completion(max_tokens=2048),
    "max_tokens string": completion(max_tokens="many"),
    "max_completion_tokens huge": chat(max_completion_tokens=HUGE),
    "temperature NaN": ("/v1/completions", '{"prompt": "Hi", "temperature": NaN}'),
    "temperature Infinity": ("/v1/completions", '{"prompt": "Hi", "temperature": Infinity}'),
    "temperature 1e400": ("/v1/completions", '{"prompt": "Hi", "temperature": 1e400}'),
    "top_p zero": completion(top_p=0),
    "top_k huge": completion(top_k=2**40),
    "top_k below -1": completion(top_k=-5),
    "repetition_penalty zero": completion(repetition_penalty=0),
    "presence_penalty huge": completion(presence_penalty=HUGE),
    "priority huge": completion(priority=2**40),
    "cache_salt empty": chat(cache_salt=""),
    "cache_salt a number": chat(cache_salt=7),
    "cache_salt a lone surrogate": ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], '
                                                            '"cache_salt": "\\ud800"}'),
    "cache_salt over 1024 characters": completion(cache_salt="s" * 1025),
    # fan-out: one request may not run more than 2 x max_num_seqs sequences
    "n zero": completion(n=0),
    "n 1000": completion(n=1000),
    "n over the fan-out": completion(n=9),
    "prompts x n over the fan-out": completion(prompt=["a", "b", "c"], n=3),
    "many prompts": completion(prompt=["Hi"] * 100),
    "best_of other than n": completion(best_of=3),
    # stop and logprobs limits
    "17 stop strings": completion(stop=[str(i) for i in range(17)]),
    "a 5000-character stop": completion(stop=["x" * 5000]),
    "stop not strings": completion(stop=[1, 2]),
    "stop_token_ids negative": completion(stop_token_ids=[-1]),
    "stop_token_ids past the vocabulary": completion(stop_token_ids=[10**9]),
    "65 stop_token_ids": completion(stop_token_ids=list(range(65))),
    "logprobs 21": completion(logprobs=21),
    "top_logprobs 21": chat(logprobs=True, top_logprobs=21),
    "top_logprobs without logprobs": chat(top_logprobs=2),
    # logit_bias as OpenAI bounds it
    "logit_bias key not a token id": completion(logit_bias={"abc": 1}),
    "logit_bias value 1000": completion(logit_bias={"5": 1000}),
    "logit_bias token past the vocabulary": completion(logit_bias={"999999": 5}),
    "logit_bias not a map": completion(logit_bias=[1, 2]),
    # messages and content parts
    "unknown role": chat(messages=[{"role": "hacker", "content": "hi"}]),
    "text part with a number": user([{"type": "text", "text": 5}]),
    "image part": user([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
    "part without a type": user([{"text": "hi"}]),
    "part that is a string": user(["hi"]),
    "content a number": user(5),
    "content an object": user({"text": "hi"}),
    "no messages": chat(messages=[]),
    "messages a string": chat(messages="hi"),
    "message a number": chat(messages=[5]),
    "deeply nested content": user([[[[[[[[[["hi"]]]]]]]]]]),
    # prompts
    "empty prompt list": completion(prompt=[]),
    "empty token list": completion(prompt=[[]]),
    "empty string": completion(prompt=""),
    "negative token id": completion(prompt=[-1]),
    "token id past the vocabulary": completion(prompt=[10**20]),
    "prompt an object": completion(prompt={"a": 1}),
    "prompt past the context": completion(prompt="hi " * 2100),
    "model a number": completion(model=5),
    "unknown model": completion(model="gpt-17"),
    "stream an object": completion(stream={"x": 1}),
    "stream_options a string": completion(stream=True, stream_options="x"),
    # bodies that are not requests
    "not JSON": ("/v1/completions", "{nope"),
    "JSON array": ("/v1/completions", "[1, 2, 3]"),
    "JSON null": ("/v1/completions", "null"),
    "deep nesting": ("/v1/completions", '{"prompt": ' + "[" * 50000 + "]" * 50000 + "}"),
    "invalid UTF-8": ("/v1/completions", b'{"prompt": "\xff\xfe\xfd"}'),
    "body over the limit": ("/v1/completions", json.dumps({"prompt": "x" * 300000})),
    # OpenAI's Responses API and Anthropic's Messages API, translated onto chat
    "responses without input": ("/v1/responses", {"max_output_tokens": 2}),
    "responses input a number": ("/v1/responses", {"input": 5}),
    "responses call without a name": ("/v1/responses", {"input": [
        {"type": "function_call", "call_id": "c", "arguments": "{}"}]}),
    "responses unknown item": ("/v1/responses", {"input": [{"type": "computer_call", "id": "x"}]}),
    "responses image input": ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}),
    "responses built-in tool": ("/v1/responses", {"input": "hi", "tools": [{"type": "web_search"}]}),
    "responses max_output_tokens huge": ("/v1/responses", {"input": "hi", "max_output_tokens": HUGE}),
    "responses unknown previous id": ("/v1/responses", {"input": "hi", "previous_response_id": "resp_nope"}),
    "responses in the background": ("/v1/responses", {"input": "hi", "background": True}),
    "responses deep nesting": ("/v1/responses", '{"input": ' + "[" * 50000 + "]" * 50000 + "}"),
    "messages without max_tokens": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),
    "messages with a system role": ("/v1/messages", {"max_tokens": 2,
                                                     "messages": [{"role": "system", "content": "x"}]}),
    "messages image block": ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}),
    "messages temperature 1.5": ("/v1/messages", {"max_tokens": 2, "temperature": 1.5,
                                                  "messages": [{"role": "user", "content": "hi"}]}),
    "messages thinking": ("/v1/messages", {"max_tokens": 2, "thinking": {"type": "enabled", "budget_tokens": 9},
                                           "messages": [{"role": "user", "content": "hi"}]}),
    "messages not JSON": ("/v1/messages", "{nope"),
    # prefix pins
    "pin ttl over the maximum": ("/v1/cache", {"prompt": "Hello there", "ttl": 10**9}),
    "pin ttl negative": ("/v1/cache", {"prompt": "Hello there", "ttl": -1}),
    "pin with prompt and messages": ("/v1/cache", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
    "pin of nothing": ("/v1/cache", {}),
}


def post(url: str, path: str, body) -> httpx.Response:
    if isinstance(body, dict | list):
        return httpx.post(url + path, json=body, timeout=60)
    data = body.encode() if isinstance(body, str) else body
    return httpx.post(url + path, content=data, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_request_gets_a_clear_4xx_and_the_server_goes_on(hostile_server, name):
    path, body = CASES[name]
    streamable = isinstance(body, dict) and path != "/v1/cache" and "stream" not in body
    for stream in (False, True) if streamable else (False,):
        response = post(hostile_server.url, path, {**body, "stream": True} if stream else body)
        assert 400 <= response.status_code < 500, (name, stream, response.status_code, response.text[:300])
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"]
    assert post(hostile_server.url, *completion()).status_code == 200
    assert post(hostile_server.url, *chat()).status_code == 200


def test_valid_extremes_are_served(hostile_server):
    """The edges of each range are served, not refused: the bounds are where they are documented."""
    for path, body in (completion(seed=2**63 - 1), completion(logit_bias={"5": -100, "6": 100}),
                       chat(logprobs=True, top_logprobs=20), completion(n=8, temperature=1.0),
                       completion(stop=["x" * 200] * 16), user([{"type": "text", "text": "Hi"}] * 3)):
        response = post(hostile_server.url, path, body)
        assert response.status_code == 200, (body, response.text[:300])


def test_logit_bias_changes_the_answer(hostile_server):
    plain = post(hostile_server.url, *completion(max_tokens=4)).json()
    token = "28"  # a digit token in SmolLM2's vocabulary
    forced = post(hostile_server.url, *completion(max_tokens=4, logit_bias={token: 100}, logprobs=0)).json()
    assert forced["choices"][0]["text"] != plain["choices"][0]["text"]
    assert len(set(forced["choices"][0]["logprobs"]["tokens"])) == 1  # the same forced token, four times


def test_websocket_frames_that_are_not_requests_get_error_events(hostile_server):
    url = hostile_server.url.replace("http", "ws") + "/v1/ws"
    frames = ["not json", "[1, 2]", "5", json.dumps({"type": "completions"}),
              json.dumps({"type": "completions", "body": "hi"}), json.dumps({"type": "explode", "body": {}}),
              json.dumps({"type": "completions", "request_id": {"a": 1}, "body": OK}),
              json.dumps({"type": "completions", "request_id": "s", "body": {**OK, "seed": 2**64}})]
    with websockets.sync.client.connect(url, open_timeout=10) as ws:
        for frame in frames:
            ws.send(frame)
            event = json.loads(ws.recv(timeout=30))
            assert event["type"] == "error" and event["status"] == 400 and event["error"]["message"], frame
        ws.send(json.dumps({"type": "completions", "request_id": "good", "body": OK}))
        kinds = []
        while not kinds or kinds[-1] not in ("done", "error"):
            kinds.append(json.loads(ws.recv(timeout=60))["type"])
        assert kinds[-1] == "done" and "chunk" in kinds


def test_nothing_leaks_after_the_hostile_table(hostile_server):
    hostile_server.wait_idle()
    assert hostile_server.metric("num_requests_waiting") == 0
    assert hostile_server.process.poll() is None
