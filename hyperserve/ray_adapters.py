"""LoRA adapters loaded at run time on a Ray Serve application: the same on every replica.

The ingress keeps the adapters the application serves (`lora_modules`, then each load and unload
since), every one with the generation of its last load, and sends that set with every request
it hands a replica. A replica brings its own adapters to the set before it answers, through its
app's own /v1/load_lora_adapter and /v1/unload_lora_adapter. So a load reaches every replica,
those that autoscaling starts later too, and a replica never answers with an adapter the
application no longer serves. A load is answered by the replica that made it: its 400 (outside
`lora_dir`, an unusable adapter) is the client's, and only its 200 changes the set. With
`lora_on_demand`, a request whose `model` is a folder of `lora_dir` holding an adapter makes that
load first (Ingress.resolve), as `hyperserve serve --lora-on-demand` does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable

from hyperserve.common.errors import APIError

logger = logging.getLogger("hyperserve.ray")

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"

AdapterSet = dict[str, tuple[str, int]]  # adapter name -> (its directory, the generation of its load)
# a replica's app, in process: (method, path, JSON body) -> (status, text)
Call = Callable[[str, str, dict], Awaitable[tuple[int, str]]]


class IngressAdapters:
    """The application's adapters, changed one load or unload at a time."""

    def __init__(self, modules: dict[str, str]) -> None:
        self.served: AdapterSet = {name: (path, 0) for name, path in modules.items()}
        self._generation = 0
        self._lock = asyncio.Lock()  # one load at a time: each one's 200 is a whole new set

    async def load(self, name: str, path: str, inplace: bool,
                   send: Callable[[AdapterSet], Awaitable[int]], if_missing: bool = False) -> None:
        """`send`: the load to a replica, with the set it makes, returning its status; a 200 makes
        that set the application's. The replica is sent the load as in place: it may hold an old
        version of the name that the set no longer has, and the check for a name already served is
        made here, against the application's set. `if_missing` (a load on demand): a name already
        served, by a load that this one waited for, is left as it is."""
        async with self._lock:
            if name in self.served and if_missing:
                return
            if name in self.served and not inplace:
                raise APIError(400, f"the name {name!r} is already served (load_inplace replaces an "
                               "adapter)", param="lora_name")
            self._generation += 1
            wanted = {**self.served, name: (path, self._generation)}
            if await send(wanted) == 200:
                self.served = wanted

    def unload(self, name: str) -> dict:
        if name not in self.served:
            raise APIError(404, f"no adapter {name!r}", param="lora_name", code="model_not_found")
        self.served = {n: entry for n, entry in self.served.items() if n != name}
        return {"id": name, "object": "model", "deleted": True}


class ReplicaAdapters:
    """What one replica's app serves of the application's set."""

    def __init__(self, modules: dict[str, str]) -> None:
        self.synced: AdapterSet = {name: (path, 0) for name, path in modules.items()}
        self._lock = asyncio.Lock()

    async def sync(self, wanted: AdapterSet, path: str, body: bytes, call: Call) -> str | None:
        """Bring the app's adapters to `wanted` before a request; for a load request, all but the
        adapter it loads, whose name is returned (the app's answer to it says whether it is in)."""
        loading = json.loads(body)["lora_name"] if path == LOAD else None  # validated at the ingress
        target = {name: entry for name, entry in wanted.items() if name != loading}
        if loading in self.synced:
            target[loading] = self.synced[loading]
        async with self._lock:
            for name in [n for n in self.synced if n not in target]:
                await call("POST", UNLOAD, {"lora_name": name})
                del self.synced[name]
            for name, (directory, generation) in target.items():
                if self.synced.get(name) == (directory, generation):
                    continue
                status, text = await call("POST", LOAD, {"lora_name": name, "lora_path": directory,
                                                         "load_inplace": True})
                if status != 200:  # e.g. the directory is missing on this node: answer 404, not the old one
                    logger.warning("adapter %s (%s) did not load on this replica: %s", name, directory, text)
                    await call("POST", UNLOAD, {"lora_name": name})
                self.synced[name] = (directory, generation)
        return loading

    def loaded(self, name: str, wanted: AdapterSet) -> None:
        """The app answered a load of `name` with 200."""
        self.synced[name] = wanted[name]
