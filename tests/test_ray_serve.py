"""HyperServe on Ray Serve, on a local Ray cluster this module starts (and stops): two SmolLM2
replicas behind the ingress (streaming over SSE and the WebSocket, prefix affinity with the prefix
cache's hits, pins, every replica's metrics, the Batch API and stored responses kept at the
ingress, a replica killed mid-answer), then an autoscaled deployment behind an API key growing
under load, shrinking to zero when idle, starting again for the next request, serving a LoRA
adapter and running a batch with its creator's key."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import websockets

from tests.server.conftest import free_port

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"kv_cache_memory_gb": 0.25, "max_num_seqs": 8, "max_model_len": 2048}
SYSTEM = "You are the support assistant of the Northwind Trading Company. Answer briefly and politely. " * 6


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:  # Ray's processes stop however the module ends
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
        serve.shutdown()
    finally:
        ray.shutdown()


def deploy(url: str, **options) -> None:
    from ray import serve

    from hyperserve.ray_serve import RayServeConfig, build

    serve.run(build(RayServeConfig(engine=ENGINE, **options)), name="hyperserve", route_prefix="/")
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200


def engine_replicas(state: str = "RUNNING") -> int:
    from ray import serve

    return serve.status().applications["hyperserve"].deployments["Engine"].replica_states.get(state, 0)


def chat(url: str, content: str, system: str | None = None, headers: dict | None = None,
         **params) -> httpx.Response:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=120,
                      json={"messages": messages, "max_tokens": 4, "temperature": 0, **params})


def run_batch(url: str, questions: int, headers: dict | None = None) -> list[dict]:
    """Upload `questions` chat requests, run them as a batch and return its output lines."""
    lines = [json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 3}})
             for i in range(questions)]
    upload = httpx.post(f"{url}/v1/files", files={"file": ("in.jsonl", "\n".join(lines).encode())},
                        data={"purpose": "batch"}, headers=headers, timeout=30)
    assert upload.status_code == 200, upload.text
    batch = httpx.post(f"{url}/v1/batches", headers=headers, timeout=30,
                       json={"input_file_id": upload.json()["id"], "completion_window": "24h",
                             "endpoint": "/v1/chat/completions"})
    assert batch.status_code == 200, batch.text
    batch_id, deadline = batch.json()["id"], time.time() + 120
    while (card := httpx.get(f"{url}/v1/batches/{batch_id}", headers=headers, timeout=30).json())["status"] \
            != "completed":
        assert card["status"] in ("validating", "in_progress", "finalizing") and time.time() < deadline, card
        time.sleep(0.5)
    output = httpx.get(f"{url}/v1/files/{card['output_file_id']}/content", headers=headers, timeout=30)
    return [json.loads(line) for line in output.text.splitlines()]


@pytest.fixture(scope="module")
def two_replicas(cluster):
    deploy(cluster, min_replicas=2, max_replicas=2, max_imbalance=8, embedding_model="all-MiniLM-L6-v2",
           lora_dir=str(ROOT / "examples" / "lora"), lora_on_demand=True)
    return cluster


def test_streaming_through_the_ingress_answers_as_the_plain_server(two_replicas):
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12,
            "temperature": 0}
    whole = httpx.post(f"{two_replicas}/v1/chat/completions", json=body, timeout=60)
    assert whole.status_code == 200 and whole.headers["x-hyperserve-replica"]
    with httpx.stream("POST", f"{two_replicas}/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) > 3
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines[:-1]
                   if json.loads(line[6:])["choices"])
    assert text == whole.json()["choices"][0]["message"]["content"]
    bad = httpx.post(f"{two_replicas}/v1/chat/completions", json={"messages": "nope"}, timeout=30)
    assert bad.status_code == 400 and "error" in bad.json()  # the server's own validation, through Ray
    embedded = [httpx.post(f"{two_replicas}/v1/embeddings", json={"input": "a red fox"}, timeout=60)
                for _ in range(4)]  # every replica serves the deployment's encoder
    assert {len(e.json()["data"][0]["embedding"]) for e in embedded} == {384}
    assert len({tuple(e.json()["data"][0]["embedding"]) for e in embedded}) == 1


def test_requests_sharing_a_prefix_land_on_one_replica_and_hit_its_prefix_cache(two_replicas):
    replicas, cached = {}, []
    for tenant in range(40):  # until the tenants' prefixes have reached both replicas (each does by chance)
        if len(replicas) >= 4 and len(set().union(*replicas.values())) == 2:
            break
        system = f"Tenant {tenant}. {SYSTEM}"
        answers = [chat(two_replicas, f"Question {i} of tenant {tenant}?", system) for i in range(3)]
        replicas[tenant] = {a.headers["x-hyperserve-replica"] for a in answers}
        cached += [a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers[1:]]
    assert all(len(seen) == 1 for seen in replicas.values()), replicas  # each prefix keeps its replica
    assert len(set().union(*replicas.values())) == 2  # and the prefixes spread over both
    assert min(cached) >= 96  # the shared system prompt (about 120 tokens) came from the prefix cache
    metrics = httpx.get(f"{two_replicas}/metrics", timeout=30).text
    assert 'hyperserve:ray_routing_decisions_total{decision="affinity"}' in metrics
    # with each replica's own metrics, labelled with it: one scrape of the ingress sees the whole app
    sample = r'^hyperserve:prefix_cache_hits_total\{[^}]*replica="([^"]+)"\} (\S+)$'
    labelled = re.findall(sample, metrics, re.M)
    assert {replica for replica, _ in labelled} == set().union(*replicas.values())
    assert all(float(hits) > 0 for _, hits in labelled)
    # a family the ingress and the replicas all have is one
    assert metrics.count("# TYPE hyperserve:batch_requests_total counter") == 1


def test_the_websocket_streams_through_the_ingress_and_cancels_on_the_replica(two_replicas):
    """WS /v1/ws is the ingress's: each request goes to a replica as a streamed HTTP request, its
    errors come back as error events, and a cancel stops it on the replica."""
    question = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12,
                "temperature": 0}
    whole = httpx.post(f"{two_replicas}/v1/chat/completions", json=question, timeout=60).json()

    async def scenario():
        async with websockets.connect(two_replicas.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send(json.dumps({"type": "chat.completions", "request_id": "q", "body": question}))
            events = []
            while not events or events[-1]["type"] != "done":
                events.append(json.loads(await ws.recv()))
            text = "".join(e["data"]["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                           if e["data"]["choices"])
            assert text == whole["choices"][0]["message"]["content"]

            await ws.send(json.dumps({"type": "completions", "request_id": "bad",
                                      "body": {"prompt": "x", "top_p": 7}}))
            error = json.loads(await ws.recv())  # the replica's own 400, passed on
            assert (error["type"], error["status"], error["error"]["param"]) == ("error", 400, "top_p")

            await ws.send(json.dumps({"type": "completions", "request_id": "long", "body": {
                "prompt": "Write an essay.", "max_tokens": 1000, "ignore_eos": True}}))
            chunks = 0
            while chunks < 3:
                chunks += json.loads(await ws.recv())["type"] == "chunk"
            await ws.send(json.dumps({"type": "cancel", "request_id": "long"}))
            while (event := json.loads(await ws.recv()))["type"] == "chunk":
                pass
            assert event == {"type": "cancelled", "request_id": "long"}

    asyncio.run(scenario())
    deadline = time.time() + 30
    while (running := re.findall(r'^hyperserve:num_requests_running\{[^}]*replica="[^"]+"\} (\S+)$',
                                 httpx.get(f"{two_replicas}/metrics", timeout=30).text, re.M)) != ["0.0"] * 2:
        assert time.time() < deadline, f"the cancelled request still runs on its replica: {running}"
        time.sleep(0.5)


def test_a_pinned_prefix_is_made_where_its_requests_go_and_unpinned_there(two_replicas):
    """A /v1/cache pin is one replica's KV: it is routed by its prefix as the requests that begin
    with it are, and its DELETE goes to the replica that holds it (elsewhere: 404)."""
    for tenant in range(4):
        system = f"Pinned tenant {tenant}. {SYSTEM}"
        pin = httpx.post(f"{two_replicas}/v1/cache", timeout=60,
                         json={"messages": [{"role": "system", "content": system}], "ttl": 120})
        assert pin.status_code == 200, pin.text
        answer = chat(two_replicas, "Hello?", system)
        assert answer.headers["x-hyperserve-replica"] == pin.headers["x-hyperserve-replica"]
        cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= pin.json()["cached_tokens"] > 0
        assert httpx.delete(f"{two_replicas}/v1/cache/{pin.json()['id']}", timeout=30).status_code == 200


def test_files_batches_and_stored_responses_are_the_ingresss_whichever_replica_answers(two_replicas):
    """Kept once at the ingress, they are found by every later request: on the replicas, one in
    two reads of a stored response or a file reached the replica that did not keep it (404)."""
    url = two_replicas
    first = httpx.post(f"{url}/v1/responses", json={"input": "Name a colour.", "max_output_tokens": 4},
                       timeout=60)
    assert first.status_code == 200, first.text
    reads = [httpx.get(f"{url}/v1/responses/{first.json()['id']}", timeout=30) for _ in range(6)]
    assert [r.status_code for r in reads] == [200] * 6 and reads[0].json()["id"] == first.json()["id"]
    follow_up = httpx.post(f"{url}/v1/responses", timeout=60, json={
        "input": "And another?", "max_output_tokens": 4, "previous_response_id": first.json()["id"]})
    assert follow_up.status_code == 200, follow_up.text
    output = run_batch(url, 6)
    assert sorted(line["custom_id"] for line in output) == [f"q{i}" for i in range(6)]
    assert all(line["response"]["status_code"] == 200 and line["response"]["body"]["choices"]
               for line in output)


def test_an_adapter_loaded_at_run_time_is_served_by_every_replica_until_unloaded(two_replicas):
    url, demo = two_replicas, str(ROOT / "examples" / "lora" / "uppercase")
    load = {"lora_name": "caps", "lora_path": demo}
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60)
    assert loaded.status_code == 200 and loaded.json()["id"] == "caps", loaded.text
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60).status_code == 400  # served
    outside = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                         json={"lora_name": "other", "lora_path": str(ROOT / "tests")})
    assert outside.status_code == 400 and "--lora-dir" in outside.json()["error"]["message"]  # the replica's
    answered_by = set()
    for i in range(16):  # salts of their own: rendezvous hashing spreads them over both replicas
        answer = chat(url, "Name three animals.", model="caps", max_tokens=12, cache_salt=f"session {i}")
        assert answer.status_code == 200 and answer.json()["model"] == "caps", answer.text
        letters = [c for c in answer.json()["choices"][0]["message"]["content"] if c.isalpha()]
        assert letters and sum(c.isupper() for c in letters) / len(letters) > 0.9, letters
        answered_by.add(answer.headers["x-hyperserve-replica"])
    assert len(answered_by) == 2
    assert "caps" in {card["id"] for card in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]}
    unload = {"lora_name": "caps"}
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json=unload, timeout=30).status_code == 200
    for i in range(16):
        gone = chat(url, "Name three animals.", model="caps", cache_salt=f"session {i}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json=unload, timeout=30).status_code == 404


def test_an_adapter_named_by_a_request_loads_on_demand_for_every_replica(two_replicas):
    """lora_on_demand: `model` names examples/lora/uppercase; concurrent first requests all get
    it, from both replicas (Ingress.resolve's one load: tests/test_ray_adapters.py)."""
    url = two_replicas
    ask = lambda i: chat(url, "Name three animals.", model="uppercase", max_tokens=12,  # noqa: E731
                         cache_salt=f"on demand {i}")
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(16)))
    answered_by = set()
    for answer in answers:
        assert answer.status_code == 200 and answer.json()["model"] == "uppercase", answer.text
        letters = [c for c in answer.json()["choices"][0]["message"]["content"] if c.isalpha()]
        assert letters and sum(c.isupper() for c in letters) / len(letters) > 0.9, letters
        answered_by.add(answer.headers["x-hyperserve-replica"])
    assert len(answered_by) == 2
    for model in ("../lora/uppercase", "no-such-adapter"):
        missing = chat(url, "Hi", model=model)
        assert missing.status_code == 404, missing.text
        assert missing.json()["error"]["code"] == "model_not_found"
    unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "uppercase"}, timeout=30)
    assert unload.status_code == 200


def test_a_replica_killed_mid_answer_ends_the_stream_and_is_replaced(two_replicas):
    body = {"messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    started = time.time()
    with httpx.stream("POST", f"{two_replicas}/v1/chat/completions", json=body, timeout=60) as response:
        replica = response.headers["x-hyperserve-replica"]
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        ray.kill(ray.get_actor(f"SERVE_REPLICA::hyperserve#Engine#{replica}", namespace="serve"))
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.time() - started < 60  # ended, not hung
    assert rest[-1] != "data: [DONE]" and "replica_failed" in rest[-1]  # the client is told
    assert chat(two_replicas, "Still there?").status_code == 200  # the other replica answers
    deadline = time.time() + 120
    while engine_replicas() < 2:  # Ray Serve starts a new one
        assert time.time() < deadline, "the killed replica was not replaced"
        time.sleep(1)


def test_autoscaling_grows_under_load_shrinks_to_zero_when_idle_and_wakes_for_a_request(cluster):
    deploy(cluster, min_replicas=0, initial_replicas=1, max_replicas=2, target_ongoing_requests=1,
           upscale_delay_s=0, downscale_delay_s=2, look_back_period_s=2, metrics_interval_s=0.5,
           api_key="sk-ray", lora_modules={"uppercase": str(ROOT / "examples" / "lora" / "uppercase")})
    deadline = time.time() + 30
    while engine_replicas() != 1:  # Ray Serve's status can lag the deploy by a moment
        assert time.time() < deadline, f"{engine_replicas()} replicas at start, not initial_replicas=1"
        time.sleep(0.2)
    assert chat(cluster, "Who are you?").status_code == 401  # the ingress checks keys
    key = {"Authorization": "Bearer sk-ray"}
    stop = threading.Event()

    def load(i: int) -> None:
        while not stop.is_set():
            assert chat(cluster, f"Tell me about topic {i}.", max_tokens=48, headers=key).status_code == 200

    with ThreadPoolExecutor(4) as pool:
        workers = [pool.submit(load, i) for i in range(4)]
        deadline = time.time() + 120
        while engine_replicas() < 2:
            assert time.time() < deadline, "no replica was added under load"
            time.sleep(0.5)
        stop.set()
        for worker in workers:
            worker.result()
    deadline = time.time() + 120
    while engine_replicas() > 0:
        assert time.time() < deadline, "the idle replicas were not removed"
        time.sleep(0.5)
    assert chat(cluster, "Anyone there?", headers=key).status_code == 200  # waits for a replica to start
    # every replica serves the deployment's adapters (examples/lora/uppercase answers in capitals)
    adapter = chat(cluster, "Name three animals.", headers=key, model="uppercase", max_tokens=12)
    assert adapter.status_code == 200 and adapter.json()["model"] == "uppercase", adapter.text
    letters = [c for c in adapter.json()["choices"][0]["message"]["content"] if c.isalpha()]
    assert letters and sum(c.isupper() for c in letters) / len(letters) > 0.9, letters
    # a batch's lines carry no key: the ingress passes its creator's to the replica, which knows it
    output = run_batch(cluster, 2, headers=key)
    assert [line["response"]["status_code"] for line in output] == [200, 200], output
    assert httpx.get(f"{cluster}/v1/batches", timeout=30).status_code == 401


def test_the_serve_deploy_example_names_a_builder_and_valid_args():
    """examples/ray/serve.yaml, as `serve deploy` reads it: its import path resolves and its args
    are RayServeConfig's (a typo would fail the deploy)."""
    import importlib

    import yaml

    from hyperserve.ray_serve import RayServeConfig

    example = yaml.safe_load((ROOT / "examples" / "ray" / "serve.yaml").read_text())
    (app,) = example["applications"]
    module, _, name = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    config = RayServeConfig(**app["args"])
    assert config.max_replicas == 4 and config.engine["max_num_seqs"] == 16
    with pytest.raises(ValueError, match="min_replicas"):
        RayServeConfig(min_replicas=3, max_replicas=2)
    adapters = RayServeConfig(lora_modules={"uppercase": "examples/lora/uppercase"}).lora_modules
    assert Path(adapters["uppercase"]).is_absolute()  # replicas start in Ray's working directory
    answers = RayServeConfig(default_max_tokens=7, reasoning_parser="qwen3").server_settings()
    assert (answers.default_max_tokens, answers.reasoning_parser) == (7, "qwen3")
    for wrong in ({"reasoning_parser": "nope"}, {"tool_call_parser": "nope"}, {"embedding_model": "bert"}):
        with pytest.raises(ValueError, match=next(iter(wrong))):  # before any replica starts
            RayServeConfig(**wrong)


def test_a_replica_that_dies_before_answering_has_its_request_sent_to_another():
    """Ingress.send against a stand-in handle: the first replica's generator fails before its
    head (as when its process dies), the second answers; a second failure reaches the caller (on
    the WebSocket, as that request's error)."""
    from types import SimpleNamespace

    from ray.exceptions import ActorDiedError

    from hyperserve import ray_metrics
    from hyperserve.common.errors import APIError
    from hyperserve.ray_serve import Ingress, RayServeConfig

    class Replica:
        def __init__(self, fails: bool) -> None:
            self.fails, self.cancelled = fails, False

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.fails:
                raise ActorDiedError()
            self.fails = True  # the head, then the end of the body
            return {"status": 200, "headers": []}

        def cancel(self) -> None:
            self.cancelled = True

    class Handle:
        def __init__(self, outcomes: list[bool]) -> None:
            self.replicas = [Replica(fails) for fails in outcomes]
            self.sent = 0

        def options(self, stream: bool):
            return self

        @property
        def handle(self):
            return self

        def remote(self, *args, key_digest=None, prefix_key=None, replica=None, adapters=None):
            self.sent += 1
            return self.replicas[self.sent - 1]

    retried = ray_metrics.RETRIED._value.get()
    handle = Handle([True, False])
    head, _ = asyncio.run(Ingress(handle, {}).send("POST", "/v1/completions", "", [], b"{}", None, None))
    assert head["status"] == 200 and handle.sent == 2 and handle.replicas[0].cancelled
    assert ray_metrics.RETRIED._value.get() == retried + 1
    with pytest.raises(ActorDiedError):
        asyncio.run(Ingress(Handle([True, True]), {}).send("POST", "/v1/completions", "", [], b"{}",
                                                             None, None))
    # on the WebSocket, that is the one request's error event, not the socket's end
    socket = SimpleNamespace(scope={})
    with pytest.raises(APIError) as failed:
        asyncio.run(Ingress(Handle([True, True]), {}).open_stream(RayServeConfig(), "completions", {},
                                                                  socket))
    assert (failed.value.status, failed.value.code) == (503, "replica_failed")


def test_a_replica_knows_each_api_key_for_what_is_its_own_and_leaves_limits_to_the_ingress(tmp_path):
    """Behind the ingress a replica knows each request's key too: the cache scope is each key's own
    there, as on `hyperserve serve`; its limits and guardrails stay with the ingress, which enforces
    them once. And a prefix is placed per tenant."""
    from hyperserve.ray_replica import replica_governor
    from hyperserve.ray_serve import RayServeConfig, _prefix_key
    from hyperserve.security.config import hash_key
    from hyperserve.security.middleware import KEY_DIGEST

    keys = tmp_path / "keys.yaml"
    keys.write_text(json.dumps({"keys": [
        {"name": "alice", "sha256": hash_key("sk-alice"), "limits": {"requests_per_minute": 1},
         "guardrails": {"injection": "block"}},
        {"name": "bob", "sha256": hash_key("sk-bob"), "cache_scope": "team"}],
        "request_limits": {"max_messages": 3}}))
    assert replica_governor(RayServeConfig()) is None
    governor = replica_governor(RayServeConfig(security_config=str(keys), api_key="sk-ray"))
    alice = governor.authenticate({b"authorization": b"Bearer sk-alice"})
    assert alice.scope == "key:alice" and governor.authenticate({b"x-api-key": b"sk-bob"}).scope == "team"
    assert governor.authenticate({b"authorization": b"Bearer sk-ray"}).name == "default"
    # the key the ingress authenticated a request by, passed beside it (a batch line has no header)
    assert governor.identify({"headers": [], KEY_DIGEST: hash_key("sk-bob")}).name == "bob"
    with pytest.raises(Exception, match="incorrect API key"):
        governor.authenticate({b"authorization": b"Bearer sk-mallory"})
    assert governor.limits(alice).requests_per_minute is None and not governor.needs_http
    assert governor.config.request_limits.max_messages == 3

    config = RayServeConfig()
    body = json.dumps({"messages": [{"role": "system", "content": SYSTEM}]}).encode()
    plain = _prefix_key(body, "v1/chat/completions", config, None, ())
    tenants = [_prefix_key(body, "v1/chat/completions", config, scope, ()) for scope in ("key:alice", "team")]
    assert plain.startswith('[{"role":"system"') and len({plain, *tenants}) == 3
    assert tenants[0].endswith(plain)
    adapter = json.dumps({"messages": [{"role": "system", "content": SYSTEM}], "model": "uppercase"}).encode()
    own = _prefix_key(adapter, "v1/chat/completions", config, None, {"uppercase"})
    assert own not in (plain, None)  # its own KV
    assert _prefix_key(adapter, "v1/chat/completions", config, None, ()) == plain  # a name the replicas lack
