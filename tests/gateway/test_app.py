"""The gateway as users run it: a `hyperserve gateway` process in front of stub backend processes."""

import asyncio
import json
import time

import httpx
import pytest
import websockets
import yaml

from tests.gateway.conftest import Stub, start_gateway

PARIS = "What's the capital of France?"


def _config(stubs, tmp_path, **overrides) -> dict:
    config = {
        "backends": [{"name": s.name, "url": s.url} for s in stubs],
        "routes": [{"model": "m", "backends": [s.name for s in stubs], "retries": 2, "backoff_s": 0.01}],
        "cache": {"store": "sqlite", "path": str(tmp_path / "cache.sqlite")},
        "breaker": {"failures": 1, "cooldown_s": 0.5},
        "log": {"path": str(tmp_path / "requests.jsonl")},
    }
    config.update(overrides)
    return config


def _stream(gateway, content: str, **params) -> tuple[httpx.Headers, str]:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0, "stream": True,
            **params}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    return response.headers, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_pass_through_streaming_and_errors(stubs, tmp_path):
    with start_gateway(_config(stubs[:1], tmp_path, cache={"enabled": False}), tmp_path) as gateway:
        reply = gateway.chat("hello", temperature=0.7)
        assert reply.status_code == 200 and reply.headers["x-hyperserve-cache"] == "bypass"
        assert reply.json()["choices"][0]["message"]["content"] == "a says: hello"
        headers, text = _stream(gateway, "hello stream")
        assert text == "a says: hello stream" and headers["x-hyperserve-backend"] == "a"
        assert gateway.chat("x", model="nope").json()["error"]["code"] == "model_not_found"
        bad = httpx.post(f"{gateway.url}/v1/chat/completions", content=b"{not json", timeout=10)
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        assert httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "m", "messages": []}).status_code == 400
        log = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
        assert log[0]["backend"] == "a" and log[0]["tokens"]["completion"] == 3 and "total" in log[0]["latency_ms"]
        assert log[1]["stream"] and log[1]["tokens"]["completion"] == 4  # usage asked upstream, not shown


def test_semantic_hits_over_http_streamed_and_after_a_restart(stubs, tmp_path):
    config = _config(stubs[:1], tmp_path)
    with start_gateway(config, tmp_path) as gateway:
        first = gateway.chat(PARIS)
        assert first.headers["x-hyperserve-cache"] == "miss"
        answer = first.json()["choices"][0]["message"]["content"]
        time.sleep(0.3)  # the insert happens after the answer went out
        hit = gateway.chat("Tell me France's capital city")
        assert hit.headers["x-hyperserve-cache"] == "hit-semantic"
        assert float(hit.headers["x-hyperserve-similarity"]) >= 0.9
        assert hit.json()["choices"][0]["message"]["content"] == answer
        headers, text = _stream(gateway, "Tell me France's capital city")
        assert headers["x-hyperserve-cache"] == "hit-semantic" and text == answer
        assert gateway.chat("What's the capital gains tax in France?").headers["x-hyperserve-cache"] == "miss"
        assert gateway.chat(PARIS, system="Answer in French.").headers["x-hyperserve-cache"] == "miss"
        assert gateway.chat(PARIS, temperature=0.7).headers["x-hyperserve-cache"] == "bypass"
        opted_in = httpx.post(f"{gateway.url}/v1/chat/completions", headers={"x-hyperserve-cache": "off"},
                              json={"model": "m", "messages": [{"role": "user", "content": PARIS}], "temperature": 0})
        assert opted_in.headers["x-hyperserve-cache"] == "bypass"
        assert stubs[0].count == 5
        assert gateway.metric("gateway_requests_total", cache="hit-semantic") == 2
    with start_gateway(config, tmp_path, name="restarted") as restarted:
        assert restarted.chat("Tell me France's capital city").headers["x-hyperserve-cache"] == "hit-semantic"
        assert stubs[0].count == 5


def test_streamed_miss_is_cached(stubs, tmp_path):
    with start_gateway(_config(stubs[:1], tmp_path), tmp_path) as gateway:
        headers, text = _stream(gateway, PARIS)
        assert headers["x-hyperserve-cache"] == "miss"
        time.sleep(0.3)
        reply = gateway.chat(PARIS)
        assert reply.headers["x-hyperserve-cache"] == "hit-exact"
        assert reply.json()["choices"][0]["message"]["content"] == text


def test_embeddings_are_routed_with_fallback_and_never_cached(stubs, tmp_path):
    a, b = stubs
    config = _config(stubs, tmp_path, backends=[{"name": "a", "url": a.url, "model": "encoder"},
                                               {"name": "b", "url": b.url}])
    with start_gateway(config, tmp_path) as gateway:
        def embed(**body) -> httpx.Response:
            return httpx.post(f"{gateway.url}/v1/embeddings", json=body, timeout=30)

        a.control(fail_status=500)
        reply = embed(model="m", input=["hello", "hi"])
        assert reply.status_code == 200 and reply.headers["x-hyperserve-backend"] == "b"  # a failed: b answered
        assert [d["embedding"] for d in reply.json()["data"]] == [[5.0, 1.0], [2.0, 1.0]]
        a.control(fail_status=None)
        b.kill()
        time.sleep(0.6)  # a's breaker cools down
        assert embed(input="hello").json()["model"] == "encoder"  # no model: the only route; a's own name upstream
        before = httpx.get(f"{a.url}/stats").json()["count"]
        embed(input="hello")
        assert httpx.get(f"{a.url}/stats").json()["count"] == before + 1  # asked again: embeddings are not cached
        assert embed(model="m").json()["error"]["param"] == "input"
        assert embed(model="nope", input="x").json()["error"]["code"] == "model_not_found"
        reranked = httpx.post(f"{gateway.url}/v1/rerank", json={"model": "m", "query": "q", "documents": ["a", "abc"]})
        assert reranked.status_code == 200, reranked.text
        assert [r["index"] for r in reranked.json()["results"]] == [1, 0] and reranked.headers[
            "x-hyperserve-backend"] == "a"  # routed as embeddings are
        log = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
        assert {entry["kind"] for entry in log} == {"embedding"}


def test_killed_backend_is_bypassed_and_readmitted(stubs, tmp_path):
    a, b = stubs
    with start_gateway(_config(stubs, tmp_path, cache={"enabled": False}), tmp_path) as gateway:
        a.kill()
        answers = [gateway.chat(f"q{i}", temperature=1) for i in range(6)]
        assert all(r.status_code == 200 for r in answers)  # nothing lost: each completed on b
        assert {r.json()["model"] for r in answers} == {"b"}
        assert httpx.get(f"{gateway.url}/health").json()["backends"]["a"] == "down"
        stubs[0] = Stub("a", a.port).start()  # back on the same port (the fixture stops it)
        time.sleep(0.6)  # the cooldown
        answers = [gateway.chat(f"r{i}", temperature=1) for i in range(4)]
        assert "a" in {r.json()["model"] for r in answers}
        assert httpx.get(f"{gateway.url}/health").json()["backends"]["a"] == "up"


def test_failures_everywhere_give_a_clear_502(stubs, tmp_path):
    a, b = stubs
    with start_gateway(_config(stubs, tmp_path, cache={"enabled": False}), tmp_path) as gateway:
        a.control(fail_status=500)
        b.kill()
        reply = gateway.chat("anything", temperature=1)
        assert reply.status_code == 502
        error = reply.json()["error"]
        assert "a: HTTP 500" in error["message"] and "b: ClientConnectorError Cannot connect" in error["message"]
        a.control(fail_status=429)
        time.sleep(0.6)
        limited = gateway.chat("anything", temperature=1)
        assert limited.status_code == 429 and "retry-after" in limited.headers


@pytest.mark.parametrize("small_logprob, escalates", [(-0.5, False), (-1.0, False), (-1.01, True), (-3.0, True)])
def test_cascade_escalates_exactly_below_the_threshold(stubs, tmp_path, small_logprob, escalates):
    small, large = stubs
    config = _config(stubs, tmp_path, cache={"enabled": False}, routes=[
        {"model": "small", "backends": ["a"]}, {"model": "large", "backends": ["b"]},
        {"model": "m", "cascade": {"models": ["small", "large"], "min_confidence": -1.0}}])
    with start_gateway(config, tmp_path) as gateway:
        small.control(logprob=small_logprob)
        reply = gateway.chat("How hard is this?")
        assert reply.status_code == 200
        assert reply.json()["model"] == ("b" if escalates else "a")
        assert reply.json()["choices"][0]["logprobs"] is None  # the client did not ask for them
        assert reply.headers["x-hyperserve-cascade"].startswith(f"small:{small_logprob:.3f}")
        assert gateway.metric("gateway_cascade_escalations_total", reason="low_confidence") == int(escalates)
        headers, text = _stream(gateway, "How hard is this?")
        assert text.startswith("b says" if escalates else "a says")
        small.control(fail_status=422)  # refused: an HTTP error, also for a streamed request
        refused = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60, json={
            "model": "m", "stream": True, "messages": [{"role": "user", "content": "How hard is this?"}]})
        assert refused.status_code == 422 and "stub failure" in refused.json()["error"]["message"]


def test_prefix_affinity_keeps_a_conversation_on_one_replica(stubs, tmp_path):
    route = {"model": "m", "backends": ["a", "b"], "balance": "prefix-affinity", "affinity_prefix_chars": 64}
    with start_gateway(_config(stubs, tmp_path, cache={"enabled": False}, routes=[route]), tmp_path) as gateway:
        def served_by(system: str) -> set[str]:
            return {gateway.chat(f"turn {i}", system=system, temperature=1).json()["model"] for i in range(4)}
        assert all(len(served_by(f"You are assistant number {n}. " * 4)) == 1 for n in range(6))
        assert len({next(iter(served_by(f"Persona {n}. " * 8))) for n in range(12)}) == 2  # prefixes spread


def test_cached_answers_never_cross_tenants_unless_their_keys_share_a_scope(stubs, tmp_path):
    from hyperserve.security.config import hash_key

    keys = [{"name": name, "sha256": hash_key(f"sk-{name}"), **extra} for name, extra in
            [("alice", {}), ("bob", {}), ("eve", {}), ("carol", {"cache_scope": "team"}),
             ("dave", {"cache_scope": "team"})]]
    (tmp_path / "keys.yaml").write_text(yaml.safe_dump({"keys": keys}))
    config = _config(stubs[:1], tmp_path)
    with start_gateway(config, tmp_path, args=("--security-config", str(tmp_path / "keys.yaml"))) as gateway:
        def cache(content: str, who: str) -> str:
            reply = gateway.chat(content, api_key=f"sk-{who}")
            assert reply.status_code == 200
            time.sleep(0.3)  # the insert happens after the answer went out
            return reply.headers["x-hyperserve-cache"]

        assert cache(PARIS, "alice") == "miss"
        assert cache(PARIS, "alice") == "hit-exact"
        assert cache("Tell me France's capital city", "alice") == "hit-semantic"
        assert cache(PARIS, "bob") == "miss"  # not alice's answer word for word
        assert cache("Tell me France's capital city", "eve") == "miss"  # nor by meaning
        assert cache(PARIS, "carol") == "miss"
        assert cache(PARIS, "dave") == "hit-exact"  # carol and dave share the scope "team"
        assert stubs[0].count == 4


def test_two_gateways_share_a_redis_cache(stubs, tmp_path, redis_url):
    cache = {"store": "redis", "redis_url": redis_url, "redis_prefix": f"gw-{time.time()}:", "timeout_s": 10.0}
    with (start_gateway(_config(stubs[:1], tmp_path, cache=cache), tmp_path, name="first") as first,
          start_gateway(_config(stubs[:1], tmp_path, cache=cache), tmp_path, name="second") as second):
        assert first.chat(PARIS).headers["x-hyperserve-cache"] == "miss"
        time.sleep(0.3)
        hit = second.chat("Tell me France's capital city")
        assert hit.headers["x-hyperserve-cache"] == "hit-semantic"
        assert hit.json()["choices"][0]["message"]["content"] == f"a says: {PARIS}"
        assert stubs[0].count == 1


def test_a_redis_cache_that_hangs_or_dies_mid_run_costs_a_timeout_not_an_answer(stubs, tmp_path, own_redis):
    cache = {"store": "redis", "redis_url": own_redis.url, "timeout_s": 0.3}
    with start_gateway(_config(stubs[:1], tmp_path, cache=cache), tmp_path) as gateway:
        assert gateway.chat(PARIS).headers["x-hyperserve-cache"] == "miss"
        time.sleep(0.3)
        assert gateway.chat(PARIS).headers["x-hyperserve-cache"] == "hit-exact"
        for outage in (own_redis.pause, own_redis.stop):  # hung, then gone
            outage()
            started = time.perf_counter()
            reply = gateway.chat(PARIS)
            assert reply.status_code == 200 and reply.headers["x-hyperserve-cache"] == "miss"
            assert reply.json()["choices"][0]["message"]["content"] == f"a says: {PARIS}"
            assert time.perf_counter() - started < 3
        assert stubs[0].count == 3


@pytest.mark.slow
def test_a_cascade_over_two_models_of_one_local_server(tmp_path):
    """SmolLM2 first, Gemma 3 when it is unsure: both served by one `hyperserve serve` process
    that the gateway starts, each stage's answer that model's own."""
    stages = ["smollm2-135m", "gemma3-270m"]
    config = {
        "backends": [{"name": "engine", "local": {"model": stages[0], "args": [
            "--model", stages[1], "--kv-cache-memory-gb", "0.25", "--max-num-seqs", "4", "--max-model-len", "4096"]}}],
        "routes": [{"model": stages[0], "backends": ["engine"]}, {"model": stages[1], "backends": ["engine"]},
                   {"model": "sure", "cascade": {"models": stages, "min_confidence": -100.0}},
                   {"model": "unsure", "cascade": {"models": stages, "min_confidence": 0.0}}],
        "cache": {"enabled": False},
        "log": {"path": str(tmp_path / "requests.jsonl")},
    }
    question = "What is the capital of France?"
    with start_gateway(config, tmp_path) as gateway:
        direct = {model: gateway.chat(question, model=model, max_tokens=12).json() for model in stages}
        assert direct[stages[0]]["model"] == stages[0] and direct[stages[1]]["model"] == stages[1]
        for route, answered_by in (("sure", stages[0]), ("unsure", stages[1])):
            reply = gateway.chat(question, model=route, max_tokens=12)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"] == direct[answered_by]["choices"][0]["message"]
            assert reply.headers["x-hyperserve-cascade"].startswith(f"{stages[0]}:")
            assert (stages[1] in reply.headers["x-hyperserve-cascade"]) == (answered_by == stages[1])


def test_a_batch_through_the_gateway_takes_its_routes(stubs, tmp_path):
    """OpenAI's Batch API on the gateway: each line is routed (a backend killed is bypassed) and
    answered as alone, its files kept in --files-dir."""
    import openai

    stubs[1].kill()
    files_dir = tmp_path / "files"
    with start_gateway(_config(stubs, tmp_path, cache={"enabled": False}), tmp_path,
                       args=("--files-dir", str(files_dir))) as gateway:
        api = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        data = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}]}})
                       + "\n" for i in range(3))
        batch = api.batches.create(input_file_id=api.files.create(file=("q.jsonl", data.encode()), purpose="batch").id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.time() + 60
        while (batch := api.batches.retrieve(batch.id)).status != "completed":
            assert time.time() < deadline, batch.status
            time.sleep(0.05)
        assert batch.error_file_id is None, api.files.content(batch.error_file_id).text
        output = [json.loads(line) for line in api.files.content(batch.output_file_id).text.splitlines()]
        assert [line["response"]["body"]["choices"][0]["message"]["content"] for line in output] == \
            [f"a says: question {i}" for i in range(3)]
        assert (files_dir / batch.output_file_id).read_text() == api.files.content(batch.output_file_id).text


def test_websocket_streams_caches_refuses_and_cancels_through_the_routes(stubs, tmp_path):
    """WS /v1/ws on the gateway speaks the server's protocol over the gateway's routes: streamed
    answers, the response cache, errors that leave the socket open, and a cancel that closes the
    backend's stream."""
    stub = stubs[0]

    async def session(url: str) -> None:
        async with websockets.connect(url.replace("http", "ws") + "/v1/ws") as ws:
            async def request(request_id: str, kind: str, body: dict) -> tuple[str, list[dict]]:
                await ws.send(json.dumps({"type": kind, "request_id": request_id, "body": body}))
                chunks = []
                while (event := json.loads(await ws.recv()))["type"] == "chunk":
                    assert event["request_id"] == request_id
                    chunks.append(event["data"])
                assert event["request_id"] == request_id
                return event, chunks

            chat = {"model": "m", "messages": [{"role": "user", "content": PARIS}], "temperature": 0}
            event, chunks = await request("first", "chat.completions", chat)
            assert event["type"] == "done"
            assert _text(chunks) == f"a says: {PARIS}"
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            await asyncio.sleep(0.3)  # the insert happens after the answer went out
            event, again = await request("again", "chat.completions", chat)
            assert event["type"] == "done" and stub.count == 1  # from the cache
            assert _text(again) == f"a says: {PARIS}"

            text = {"model": "m", "prompt": "hi there", "seed": 1, "temperature": 0.5}
            event, chunks = await request("text", "completions", text)
            assert event["type"] == "done"
            assert "".join(c["choices"][0]["text"] for c in chunks) == "a says: hi there"

            event, _ = await request("empty", "chat.completions", {"model": "m", "messages": []})
            assert event["type"] == "error" and event["status"] == 400
            assert event["error"]["param"] == "messages"
            event, _ = await request("nope", "chat.completions", {**chat, "model": "nope"})
            assert event["type"] == "error" and event["error"]["code"] == "model_not_found"

            stub.control(token_delay_s=0.5)
            long = {"model": "m", "messages": [{"role": "user", "content": "word " * 30}], "temperature": 0.7}
            await ws.send(json.dumps({"type": "chat.completions", "request_id": "long", "body": long}))
            assert json.loads(await ws.recv())["type"] == "chunk"
            await ws.send(json.dumps({"type": "cancel", "request_id": "long"}))
            while (event := json.loads(await ws.recv()))["type"] == "chunk":
                pass
            assert event == {"type": "cancelled", "request_id": "long"}
            deadline = time.time() + 10
            while httpx.get(f"{stub.url}/stats").json()["open_streams"] and time.time() < deadline:
                await asyncio.sleep(0.1)
            # the gateway closed the backend's stream (31 tokens at 0.5 s would take 15 s)
            assert httpx.get(f"{stub.url}/stats").json()["open_streams"] == 0

            stub.control(token_delay_s=0.0, fail_status=422)
            event, _ = await request("refused", "chat.completions", {**chat, "temperature": 0.7})
            assert event["type"] == "error" and event["status"] == 422
            assert "stub failure" in event["error"]["message"]
            stub.control(fail_status=None)
            event, _ = await request("after", "chat.completions", {**chat, "temperature": 0.7})
            assert event["type"] == "done"

    with start_gateway(_config(stubs[:1], tmp_path), tmp_path) as gateway:
        asyncio.run(session(gateway.url))
        log = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
        assert [entry["cache"] for entry in log if entry["status"] == 200][:2] == ["miss", "hit-exact"]


def _text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
