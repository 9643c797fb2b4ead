"""The Batch API in front of a stub app, through OpenAI's own SDK: files, batches, their lines' answers
and errors, retries of 429, cancellation, validation, owners and size limits."""

from __future__ import annotations

import asyncio
import contextvars
import json
import tempfile
import time

import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from hyperserve.common.batch_api import BATCH_PRIORITY, BatchAPI
from hyperserve.security.config import SecurityConfig, hash_key
from hyperserve.security.middleware import Governor, add_security

KEYS = {"alice": "key-alice", "bob": "key-bob"}


@pytest.fixture
def client(tmp_path):
    """A stub chat endpoint that echoes its body: 400 for `fail`, 429 once for `busy`, and for
    `wait` an answer only once the client disconnects (counted in `app.state.aborted`)."""
    governor = Governor(SecurityConfig.model_validate(
        {"keys": [{"name": name, "sha256": hash_key(key)} for name, key in KEYS.items()]}))
    app = FastAPI()
    app.state.busy, app.state.aborted = set(), 0
    add_security(app, governor)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if body.get("fail"):
            error = {"error": {"message": "bad", "type": "invalid_request_error"}}
            return JSONResponse(error, status_code=400)
        if body.get("busy") and body["busy"] not in app.state.busy:
            app.state.busy.add(body["busy"])
            return JSONResponse({"error": {"message": "busy"}}, status_code=429, headers={"Retry-After": "0"})
        if body.get("wait"):
            while not await request.is_disconnected():
                await asyncio.sleep(0.01)
            app.state.aborted += 1
        return {"echo": body}

    app.state.registry = CollectorRegistry()
    app.add_middleware(BatchAPI, governor=governor, files_dir=tmp_path / "files", max_file_bytes=4096,
                       concurrency=2, registry=app.state.registry)
    with TestClient(app) as client:
        yield client


def sdk(client, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEYS[who], http_client=client)


def jsonl(*bodies: dict, url: str = "/v1/chat/completions") -> bytes:
    return "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}) + "\n"
                   for i, body in enumerate(bodies)).encode()


def finished(api: openai.OpenAI, batch_id: str, timeout: float = 10):
    deadline = time.time() + timeout
    ended = ("completed", "failed", "cancelled", "expired")
    while (batch := api.batches.retrieve(batch_id)).status not in ended:
        assert time.time() < deadline, batch.status
        time.sleep(0.02)
    return batch


def start(api: openai.OpenAI, file_id: str, **options):
    """A batch of chat requests over an uploaded file."""
    return api.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                              **options)


def lines(api: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in api.files.content(file_id).text.splitlines()] if file_id else []


def test_a_batch_answers_each_line_through_the_app_in_order(client):
    api = sdk(client)
    data = jsonl({"n": 1}, {"n": 2, "fail": True}, {"n": 3, "busy": "x"},
                 {"n": 4, "priority": -5, "stream": True})
    upload = api.files.create(file=("in.jsonl", data), purpose="batch")
    assert (upload.purpose, upload.bytes, upload.filename) == ("batch", len(data), "in.jsonl")
    batch = start(api, upload.id, metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    batch = finished(api, batch.id)
    assert batch.status == "completed" and batch.completed_at and batch.in_progress_at
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (4, 3, 1)
    output = lines(api, batch.output_file_id)
    assert [line["custom_id"] for line in output] == ["r0", "r2", "r3"]  # input order; the 429 was retried
    echoed = [line["response"]["body"]["echo"] for line in output]
    assert [(e["n"], e["priority"], e["stream"]) for e in echoed] == [
        (1, BATCH_PRIORITY, False), (3, BATCH_PRIORITY, False), (4, -5, False)]
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in output)
    [error] = lines(api, batch.error_file_id)
    assert (error["custom_id"], error["response"]["status_code"]) == ("r1", 400)
    assert error["response"]["body"]["error"]["message"] == "bad"
    assert api.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert [b.id for b in api.batches.list()] == [batch.id]
    metric = client.app.state.registry.get_sample_value
    assert [metric("hyperserve:batch_requests_total", {"outcome": o}) for o in ("answered", "failed")] \
        == [3, 1]
    assert metric("hyperserve:batches_running") == 0


def test_an_invalid_input_file_fails_the_batch_saying_which_lines(client):
    api = sdk(client)
    good = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}})
    data = "\n".join([good, "not json", good, json.dumps({"custom_id": "b", "method": "GET",
                                                          "url": "/v1/chat/completions", "body": {}}),
                      json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {}})])
    upload = api.files.create(file=("in.jsonl", data.encode()), purpose="batch")
    batch = finished(api, api.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id)
    assert batch.status == "failed" and batch.failed_at
    assert [(e.line, e.message) for e in batch.errors.data] == [
        (2, "the line is not a JSON object"), (3, "custom_id 'a' appears twice"), (4, "method must be POST"),
        (5, "url must be the batch's endpoint, /v1/chat/completions")]


def test_a_cancelled_batch_aborts_its_running_lines_and_keeps_what_finished(client):
    api = sdk(client)
    upload = api.files.create(file=("in.jsonl", jsonl({"n": 0}, *({"wait": True} for _ in range(4)))),
                              purpose="batch")
    batch = start(api, upload.id)
    deadline = time.time() + 10
    while api.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.time() < deadline
        time.sleep(0.02)
    assert api.batches.cancel(batch.id).status == "cancelling"
    batch = finished(api, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    assert [line["custom_id"] for line in lines(api, batch.output_file_id)] == ["r0"]
    errors = lines(api, batch.error_file_id)
    assert len(errors) == 4 and client.app.state.aborted == 2  # two ran (concurrency 2) and were disconnected
    assert {e["error"]["code"] for e in errors if e["response"] is None} == {"batch_cancelled"}
    metric = client.app.state.registry.get_sample_value
    assert metric("hyperserve:batch_requests_total", {"outcome": "not_run"}) == 4


def test_files_and_batches_are_their_owners_alone_and_need_a_key(client):
    alice, bob = sdk(client), sdk(client, "bob")
    upload = alice.files.create(file=("in.jsonl", jsonl({"n": 1})), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(upload.id)
    with pytest.raises(openai.NotFoundError):
        start(bob, upload.id)
    batch = start(alice, upload.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    assert [f.id for f in bob.files.list()] == [] and upload.id in [f.id for f in alice.files.list()]
    assert client.get("/v1/files").status_code == 401
    assert client.get(f"/v1/batches/{batch.id}", headers={"Authorization": "Bearer wrong"}).status_code == 401
    finished(alice, batch.id)
    assert alice.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        alice.files.content(upload.id)


@pytest.mark.parametrize("call, status, says", [
    (lambda api: api.files.create(file=("big.jsonl", b"x" * 8192), purpose="batch"), 413, "at most 4096"),
    (lambda api: api.files.create(file=("a.jsonl", b"{}"), purpose="fine-tune"), 400, "purpose must be"),
    (lambda api: api.batches.create(input_file_id="file_none", endpoint="/v1/chat/completions",
                                    completion_window="24h"), 404, "no file"),
    (lambda api: api.batches.create(input_file_id="file_none", endpoint="/v1/moderations",
                                    completion_window="24h"), 400, "endpoint must be"),
    (lambda api: api.batches.create(input_file_id="file_none", endpoint="/v1/chat/completions",
                                    completion_window="1h"), 400, "completion_window"),
])
def test_bad_requests_get_clear_errors(client, call, status, says):
    with pytest.raises(openai.APIStatusError) as error:
        call(sdk(client))
    assert error.value.status_code == status and says in error.value.message


def test_a_restarted_server_keeps_files_and_batches_and_goes_on_without_sending_lines_again(tmp_path):
    """A server stopped with a batch half done and started again on the same files directory lists
    its files and batches, runs the lines that had not finished (with the creator's key, which it
    never stored) and not the others, and writes every line's answer in order."""
    def build(holding: bool) -> FastAPI:
        governor = Governor(SecurityConfig.model_validate(
            {"keys": [{"name": name, "sha256": hash_key(key)} for name, key in KEYS.items()]}))
        app = FastAPI()
        app.state.seen = []
        add_security(app, governor)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await request.json()
            app.state.seen.append(body["n"])
            while holding and body.get("hold"):  # until the server stops
                await asyncio.sleep(0.01)
            return {"echo": body["n"]}

        app.add_middleware(BatchAPI, governor=governor, files_dir=tmp_path / "files", concurrency=2)
        return app

    first = build(holding=True)
    with TestClient(first) as client:
        api = sdk(client)
        upload = api.files.create(file=("in.jsonl", jsonl({"n": 1}, {"n": 2}, {"n": 3, "hold": True},
                                                          {"n": 4, "hold": True}, {"n": 5})), purpose="batch")
        batch = start(api, upload.id)
        deadline = time.time() + 10
        while api.batches.retrieve(batch.id).request_counts.completed < 2 or len(first.state.seen) < 4:
            assert time.time() < deadline
            time.sleep(0.02)
    assert sorted(first.state.seen) == [1, 2, 3, 4]  # 3 and 4 held both slots when it stopped

    second = build(holding=False)
    with TestClient(second) as client:
        api = sdk(client)
        done = finished(api, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 5
        assert {f.id for f in api.files.list()} == {upload.id, done.output_file_id}
        echoed = [line["response"]["body"]["echo"] for line in lines(api, done.output_file_id)]
        assert echoed == [1, 2, 3, 4, 5]
        assert sorted(second.state.seen) == [3, 4, 5]  # what had not finished, and no line twice
        with pytest.raises(openai.NotFoundError):
            sdk(client, "bob").batches.retrieve(batch.id)


def test_a_batch_whose_results_cannot_be_stored_fails_saying_why():
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete():
        return {"text": "x" * 100}

    data = jsonl({"prompt": "a"}, url="/v1/completions")
    app.add_middleware(BatchAPI, max_stored_bytes=len(data) + 50)
    with TestClient(app) as client:
        api = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=client)
        upload = api.files.create(file=("in.jsonl", data), purpose="batch")
        batch = finished(api, api.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                 completion_window="24h").id)
    assert batch.status == "failed" and "delete some first" in batch.errors.data[0].message


def test_a_server_without_a_files_directory_removes_its_temporary_one_at_shutdown(tmp_path, monkeypatch):
    """uvicorn ends a SIGTERM-stopped server by the signal, so the app's shutdown is what removes it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    app = FastAPI()
    app.add_middleware(BatchAPI)
    with TestClient(app) as client:
        api = openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=client)
        api.files.create(file=("in.jsonl", jsonl({"prompt": "a"})), purpose="batch")
        assert [path.name[:17] for path in tmp_path.iterdir()] == ["hyperserve-files-"]
    assert list(tmp_path.iterdir()) == []


def test_a_batch_request_body_is_bounded(client):
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    response = client.post("/v1/batches", headers=headers, content=b'{"metadata": "' + b"x" * 100_000 + b'"}')
    assert response.status_code == 413 and "too large" in response.json()["error"]["message"]


def test_lines_run_in_a_context_of_their_own_not_their_creators(tmp_path):
    """A line does not see the context variables of the request that created its batch: Ray Serve
    keys the requests its handles send by one (the request id), and lines that shared their
    creator's stalled its router (tests/test_ray_serve.py)."""
    request_id = contextvars.ContextVar("request_id", default=None)
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        return {"request_id": request_id.get()}

    app.add_middleware(BatchAPI, files_dir=tmp_path)

    async def server(scope, receive, send):  # what a server around the app sets for each request
        request_id.set(f"{scope['type']} {scope.get('path')}")
        await app(scope, receive, send)

    with TestClient(server) as client:
        api = sdk(client)
        upload = api.files.create(file=("in.jsonl", jsonl({"n": 1}, {"n": 2})), purpose="batch")
        batch = start(api, upload.id)
        answers = [line["response"]["body"] for line in lines(api, finished(api, batch.id).output_file_id)]
    assert answers == [{"request_id": None}] * 2
