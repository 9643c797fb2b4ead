"""LoRA adapters loaded at run time on Ray Serve (hyperserve/ray_adapters.py), without a cluster: the
set the ingress keeps, and how a replica's app is brought to it (its own load and unload calls)."""

from __future__ import annotations

import asyncio
import json

import pytest

from hyperserve.common.errors import APIError
from hyperserve.ray_adapters import LOAD, UNLOAD, IngressAdapters, ReplicaAdapters


class FakeApp:
    """A replica's app as the sync calls it: what it serves, and every call made."""

    def __init__(self, serves: dict[str, str], missing: tuple[str, ...] = ()) -> None:
        self.serves, self.missing, self.calls = dict(serves), missing, []

    async def __call__(self, method: str, path: str, body: dict) -> tuple[int, str]:
        self.calls.append((path, body["lora_name"]))
        if path == UNLOAD:
            return (200, "") if self.serves.pop(body["lora_name"], None) else (404, "no adapter")
        if body["lora_path"] in self.missing:
            return 400, "missing"
        self.serves[body["lora_name"]] = body["lora_path"]
        return 200, ""


def sync(adapters: ReplicaAdapters, wanted: dict, app: FakeApp, path: str = "/v1/completions",
         body: bytes = b"{}") -> str | None:
    return asyncio.run(adapters.sync(wanted, path, body, app))


def test_a_replica_loads_what_it_lacks_reloads_a_new_generation_in_place_and_unloads_the_rest():
    replica, app = ReplicaAdapters({"static": "/a/static"}), FakeApp({"static": "/a/static"})
    sync(replica, {"static": ("/a/static", 0)}, app)
    assert app.calls == []  # in step: nothing to do
    sync(replica, {"static": ("/a/static", 0), "new": ("/a/new", 1)}, app)
    assert app.calls == [(LOAD, "new")] and app.serves["new"] == "/a/new"
    sync(replica, {"new": ("/a/new", 2)}, app)  # loaded again (new weights), and static unloaded
    assert app.calls[1:] == [(UNLOAD, "static"), (LOAD, "new")] and set(app.serves) == {"new"}


def test_an_adapter_that_does_not_load_on_a_replica_is_unloaded_there_and_not_tried_again():
    replica, app = ReplicaAdapters({}), FakeApp({"old": "/a/old"}, missing=("/elsewhere",))
    replica.synced = {"old": ("/a/old", 1)}
    wanted = {"old": ("/elsewhere", 2)}
    sync(replica, wanted, app)
    assert app.calls == [(LOAD, "old"), (UNLOAD, "old")] and app.serves == {}  # a 404, never the old weights
    sync(replica, wanted, app)
    assert len(app.calls) == 2


def test_a_load_request_is_left_to_the_app_and_counts_once_it_answers_200():
    replica, app = ReplicaAdapters({}), FakeApp({})
    wanted = {"other": ("/a/other", 1), "caps": ("/a/caps", 2)}
    body = json.dumps({"lora_name": "caps", "lora_path": "/a/caps"}).encode()
    assert sync(replica, wanted, app, LOAD, body) == "caps"
    assert app.calls == [(LOAD, "other")]  # caps is the request's own to load
    replica.loaded("caps", wanted)
    sync(replica, wanted, app)
    assert app.calls == [(LOAD, "other")]


def test_the_ingress_set_changes_on_a_replicas_200_only():
    ingress = IngressAdapters({"static": "/a/static"})
    sent = []

    def send(status: int):
        async def call(wanted):
            sent.append(wanted)
            return status
        return call

    asyncio.run(ingress.load("caps", "/a/caps", False, send(400)))
    assert ingress.served == {"static": ("/a/static", 0)}
    asyncio.run(ingress.load("caps", "/a/caps", False, send(200)))
    assert ingress.served["caps"] == ("/a/caps", 2) and sent[1]["caps"] == ("/a/caps", 2)
    with pytest.raises(APIError, match="already served"):
        asyncio.run(ingress.load("caps", "/a/v2", False, send(200)))
    asyncio.run(ingress.load("caps", "/a/v2", True, send(200)))
    assert ingress.served["caps"] == ("/a/v2", 3)
    assert ingress.unload("caps") == {"id": "caps", "object": "model", "deleted": True}
    with pytest.raises(APIError, match="no adapter") as gone:
        ingress.unload("caps")
    assert gone.value.status == 404
