"""LoRA adapters loaded at run time on Ray Serve (hyperserve/ray_adapters.py), without a cluster: the
set the ingress keeps, and how a replica's app is brought to it (its own load and unload calls)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hyperserve.common.errors import APIError
from hyperserve.ray_adapters import LOAD, UNLOAD, IngressAdapters, ReplicaAdapters

ROOT = Path(__file__).resolve().parents[1]


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


def test_a_load_on_demand_leaves_a_name_already_served_alone():
    ingress = IngressAdapters({"caps": "/a/caps"})
    sent = []

    async def send(wanted):
        sent.append(wanted)
        return 200

    asyncio.run(ingress.load("caps", "/a/other", False, send, if_missing=True))
    assert sent == [] and ingress.served == {"caps": ("/a/caps", 0)}


class OnDemandIngress:
    """The ingress's resolve, its loads answered by `status` and counted, without a cluster."""

    def __init__(self, status: int = 200, **config) -> None:
        from hyperserve.ray_serve import Ingress, RayServeConfig

        config = {"lora_dir": str(ROOT / "examples" / "lora"), "lora_on_demand": True, **config}
        self.config = RayServeConfig(**config)
        self.ingress, self.loads = Ingress(None, {}), []

        async def send(method, path, query, headers, body, key_digest, prefix_key, adapters=None):
            self.loads.append((json.loads(body), dict(adapters)))
            await asyncio.sleep(0.01)  # the other requests arrive while it loads
            return {"status": status, "headers": []}, answer(status)

        async def answer(code: int):
            yield json.dumps({"error": {"message": "no good", "code": None}} if code != 200 else {}).encode()

        self.ingress.send = send

    def resolve(self, *bodies: bytes) -> list:
        async def all_of():
            return await asyncio.gather(*(self.ingress.resolve(self.config, body, [], None)
                                          for body in bodies))
        return asyncio.run(all_of())


def test_concurrent_requests_naming_an_adapter_folder_load_it_once():
    on_demand = OnDemandIngress()
    body = b"  " + json.dumps({"model": "uppercase", "messages": []}, indent=1).encode()
    assert on_demand.resolve(body, body, body, body) == [None] * 4
    assert len(on_demand.loads) == 1
    load, wanted = on_demand.loads[0]
    assert load["lora_name"] == "uppercase"
    assert load["lora_path"] == str(ROOT / "examples" / "lora" / "uppercase")
    assert load["load_inplace"] and "uppercase" in wanted
    assert "uppercase" in on_demand.ingress.adapters.served


@pytest.mark.parametrize("model", ["../lora/uppercase", "no-such-adapter", "smollm2-135m", ["uppercase"],
                                   None])
def test_a_request_naming_no_adapter_folder_loads_nothing(model):
    on_demand = OnDemandIngress()
    bodies = [json.dumps({"model": model}).encode(), b"{not json", b"[1]", b""]
    assert on_demand.resolve(*bodies) == [None] * 4 and on_demand.loads == []


def test_an_adapter_that_cannot_load_on_demand_is_the_requests_answer():
    on_demand = OnDemandIngress(status=400)
    refused, = on_demand.resolve(json.dumps({"model": "uppercase"}).encode())
    assert refused.status_code == 400 and b"no good" in refused.body
    assert "uppercase" not in on_demand.ingress.adapters.served


def test_on_demand_loading_needs_a_lora_dir():
    from hyperserve.ray_serve import RayServeConfig

    with pytest.raises(ValueError, match="lora_dir"):
        RayServeConfig(lora_on_demand=True)
    assert not OnDemandIngress(lora_on_demand=False).resolve(json.dumps({"model": "uppercase"}).encode())[0]
