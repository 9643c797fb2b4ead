"""RuntimeAdapters: the LoRA adapters a server loads and unloads while it runs, on its first model.

POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), from inside `--lora-dir` only;
with `--lora-on-demand`, also a request whose `model` is no model or adapter served but names a
folder of `--lora-dir` that holds an adapter (vLLM's filesystem LoRA resolver): it is loaded as
the load endpoint would, and the request runs with it. Each load gives the adapter a new id, so a
name loaded again is read afresh (engine/lora_manager.py); loads go one at a time, so two
requests for a new name load it once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from hyperserve.common.errors import APIError
from hyperserve.common.lora_folders import adapter_folder
from hyperserve.layers.lora import LoRARequest
from hyperserve.server.model_pool import ModelPool
from hyperserve.server.openai_api import OpenAIServing


class RuntimeAdapters:
    def __init__(self, pool: ModelPool, lora_dir: Path | None, on_demand: bool,
                 serving: Callable[[str | None], Awaitable[OpenAIServing]]) -> None:
        if on_demand and lora_dir is None:
            raise ValueError("loading adapters on demand needs a --lora-dir to find them in")
        self.pool, self.on_demand, self.serving = pool, on_demand, serving
        self.lora_dir = lora_dir.resolve() if lora_dir is not None else None
        self._loads = asyncio.Lock()

    async def load(self, name: str, path: str, inplace: bool = False) -> dict[str, Any]:
        """Serve the adapter at `path` as `name` (with `inplace`, in place of the one of that name:
        requests already running finish with the old one); 400 with the reason if it cannot be."""
        async with self._loads:
            return await self._load(name, path, inplace)

    async def _load(self, name: str, path: str, inplace: bool) -> dict[str, Any]:
        model = self.pool.model(None)
        replaced = model.entry.adapters.get(name) if inplace else None
        if self.pool.find(name) is not None and replaced is None:
            raise APIError(400, f"the name {name!r} is already served (load_inplace replaces an adapter)",
                           param="lora_name")
        if self.lora_dir is None:
            raise APIError(400, "this server loads no adapters at run time: start it with --lora-dir",
                           param="lora_path")
        try:
            directory = Path(path).resolve()
        except (OSError, ValueError) as error:  # a NUL byte, a loop of links
            raise APIError(400, f"lora_path is not a usable path: {error}", param="lora_path") from error
        if not directory.is_relative_to(self.lora_dir):
            raise APIError(400, "lora_path must be inside the server's --lora-dir", param="lora_path")
        lora = LoRARequest(name, model.entry.new_lora_id(), str(directory))
        s = await self.serving(model.name)
        try:
            await asyncio.to_thread(s.engine.engine.check_lora, lora)
        except ValueError as error:
            raise APIError(400, str(error), param="lora_path") from error
        model.entry.adapters[name] = lora
        if replaced is not None:
            s.engine.engine.forget_lora(replaced)
        return {"id": name, "object": "model", "parent": model.name, "root": lora.lora_path}

    def unload(self, name: str) -> dict[str, Any]:
        """Stop serving an adapter: requests already running finish with it, then its memory goes
        (a later load of the name, from any directory, reads its files again)."""
        model = self.pool.model(name)
        lora = model.entry.adapters.pop(name, None)
        if lora is None:
            raise APIError(404, f"no adapter {name!r}", param="lora_name", code="model_not_found")
        if model.serving is not None:
            model.serving.engine.engine.forget_lora(lora)
        return {"id": name, "object": "model", "deleted": True}

    async def resolve(self, model: str | None) -> None:
        """With on-demand loading, load the adapter a request names if it is not served yet and
        --lora-dir has a folder of that name with an adapter_config.json (otherwise the request
        goes on to its 404)."""
        if not self.on_demand or self.pool.find(model) is not None:
            return
        directory = adapter_folder(self.lora_dir, model)
        if directory is None:
            return
        async with self._loads:
            if self.pool.find(model) is None:  # not loaded by a request that waited before this one
                await self._load(model, str(directory), inplace=False)
