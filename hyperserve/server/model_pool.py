"""Several models behind one endpoint: each with its own engine and KV pool, routed by `model`.

A pinned model loads when the server starts and stays. An on-demand model loads when a request
(or POST /v1/models/{name}/load) first names it, that request waiting for the load, and unloads
after `idle_unload_s` without requests, or earlier when loading another would exceed
`max_loaded_models` or the memory budget: then the least recently used idle on-demand model goes
first. If every loaded model is pinned or busy, or the model is larger than the whole budget,
the request gets 503 with the reason. Unloading stops the engine's thread, drops its weights and
KV pool and hands the freed heap back to the OS.

A model's size in the budget is its weights and its KV pool at full size (`LLMEngine.memory_bytes`),
measured at its first load; before that, `ModelEntry.memory_estimate` (weight files and the KV
pool's budget).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hyperserve.common.errors import APIError, unavailable
from hyperserve.engine.engine import LLMEngine
from hyperserve.engine.memory import return_freed_heap
from hyperserve.layers.lora import LoRARequest
from hyperserve.server.async_engine import AsyncEngine
from hyperserve.server.metrics import ModelMetrics, ServerMetrics
from hyperserve.server.openai_api import OpenAIServing
from hyperserve.server.settings import ServerSettings

logger = logging.getLogger("hyperserve.models")


@dataclass
class ModelEntry:
    name: str
    load_engine: Callable[[], LLMEngine]
    on_demand: bool = False  # False: loaded at start, never unloaded
    adapters: dict[str, LoRARequest] = field(default_factory=dict)  # LoRA adapters served as models, by name
    memory_estimate: int = 0  # bytes it will hold, until a load measures them
    _last_lora_id: int = field(default=0, init=False, repr=False)

    def new_lora_id(self) -> int:
        """An adapter id this model has never given: each load is a new adapter to the engine, so
        one loaded again (new files, or the same) is read afresh, never mistaken for the old one."""
        self._last_lora_id = 1 + max([self._last_lora_id, *(a.lora_int_id for a in self.adapters.values())])
        return self._last_lora_id


class ServedModel:
    """One model's engine, loaded or not."""

    def __init__(self, entry: ModelEntry, settings: ServerSettings, metrics: ModelMetrics,
                 on_engine_dead: Callable[[BaseException], None] | None) -> None:
        self.entry, self.metrics, self.on_engine_dead = entry, metrics, on_engine_dead
        self.settings = replace(settings, model_name=entry.name)
        self.async_engine: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.load_error: str | None = None
        self.last_used = time.monotonic()
        self.measured_bytes: int | None = None
        self._loading: asyncio.Future | None = None

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def loading(self) -> bool:
        return self._loading is not None

    @property
    def memory_bytes(self) -> int:
        return self.entry.memory_estimate if self.measured_bytes is None else self.measured_bytes

    @property
    def busy(self) -> bool:
        """Requests queued or running (an idle model can be unloaded)."""
        engine = self.async_engine
        return engine is not None and (engine.num_waiting > 0 or engine.engine.num_running > 0)

    async def load(self) -> OpenAIServing:
        """Loaded (waiting for a load in progress, or starting one); raises what loading raised."""
        if self.serving is not None:
            return self.serving
        if self._loading is None:
            self._loading = asyncio.ensure_future(self._load())
        return await asyncio.shield(self._loading)

    async def _load(self) -> OpenAIServing:
        started = time.perf_counter()
        self.metrics.new_engine()
        engine = AsyncEngine(self.entry.load_engine, on_step=self.metrics.observe_step,
                             on_dead=self.on_engine_dead)
        try:
            await asyncio.wrap_future(engine.ready)
        except Exception as error:
            self.load_error = f"{type(error).__name__}: {error}"
            logger.exception("model %s failed to load", self.name)
            raise
        finally:
            self._loading = None
        try:
            serving = OpenAIServing(engine, self.settings, self.entry.adapters)
        except ValueError as error:  # a server setting this engine cannot honour
            self.load_error = str(error)
            await asyncio.to_thread(engine.shutdown)
            raise
        self.load_error = None
        self.async_engine, self.serving = engine, serving
        self.last_used = time.monotonic()
        weights, kv_pool = engine.engine.weight_bytes(), engine.engine.kv_pool_bytes()
        self.measured_bytes = weights + kv_pool
        # a CPU's KV pool takes memory only as it fills; a GPU's is allocated whole
        taken = ", taken as it fills" if engine.engine.config.model.device == "cpu" else ""
        logger.info("model %s ready (loaded in %.1f s; weights %.2f GiB, KV pool up to %.2f GiB%s)",
                    self.name, time.perf_counter() - started, weights / 2**30, kv_pool / 2**30, taken)
        return self.serving

    async def unload(self) -> None:
        engine, serving, self.async_engine, self.serving = self.async_engine, self.serving, None, None
        if engine is None:
            return
        await serving.aclose()
        await asyncio.to_thread(engine.shutdown)
        del engine
        gc.collect()  # the engine's tensors go with their last reference...
        return_freed_heap()  # ...and the heap pages they held back to the OS
        self.metrics.engine_gone()
        logger.info("model %s unloaded", self.name)


class ModelPool:
    def __init__(self, entries: list[ModelEntry], settings: ServerSettings, metrics: ServerMetrics,
                 on_engine_dead: Callable[[BaseException], None] | None = None,
                 max_loaded_models: int | None = None, idle_unload_s: float | None = 300.0,
                 memory_budget_bytes: int | None = None) -> None:
        if not entries or len({e.name for e in entries}) != len(entries):
            raise ValueError("give at least one model, each under its own name")
        self.models = {e.name: ServedModel(e, settings, metrics.for_model(e.name), on_engine_dead)
                       for e in entries}
        self.default = entries[0].name  # serves requests that name no model
        self.max_loaded_models = max_loaded_models
        self.idle_unload_s = idle_unload_s
        self.memory_budget_bytes = memory_budget_bytes
        self._admission = asyncio.Lock()  # one load decision at a time

    @property
    def pinned(self) -> list[ServedModel]:
        return [m for m in self.models.values() if not m.entry.on_demand]

    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.serving is not None]

    def find(self, name: str) -> ServedModel | None:
        """The model `name` is, or the base of the LoRA adapter it is; None if neither."""
        return self.models.get(name) or next(
            (m for m in self.models.values() if name in m.entry.adapters), None)

    def model(self, name: str | None) -> ServedModel:
        """The model a request's `model` names: a model, or the base of a LoRA adapter."""
        name = self.default if name is None else name
        model = self.find(name)
        if model is None:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{sorted(self.models)}", param="model", code="model_not_found")
        return model

    async def serving(self, name: str | None) -> OpenAIServing:
        """The model's OpenAIServing, loading an on-demand model first (and making room for it)."""
        model = self.model(name)
        model.last_used = time.monotonic()
        if model.serving is not None:
            return model.serving
        if not model.entry.on_demand:  # pinned: loading at start, or failed there
            raise unavailable(f"the model {model.name!r} failed to load: {model.load_error}"
                              if model.load_error else f"the model {model.name!r} is loading")
        async with self._admission:
            if model.serving is None and not model.loading:
                await self._make_room(model)
        try:
            return await model.load()
        except Exception as error:
            raise unavailable(f"the model {model.name!r} failed to load: {type(error).__name__}: {error}",
                              retry_after_s=10) from error

    def _held(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.serving is not None or m.loading]

    def _shortage(self, model: ServedModel) -> str | None:
        """Why `model` does not fit beside the loaded (and loading) models now; None: it does."""
        if self.max_loaded_models is not None and len(self._held()) >= self.max_loaded_models:
            return f"{self.max_loaded_models} models are loaded (max_loaded_models)"
        return self._memory_shortage(model)

    def _memory_shortage(self, model: ServedModel) -> str | None:
        """Why `model` does not fit in the memory budget beside the models held now; None: it does."""
        budget, in_use = self.memory_budget_bytes, sum(m.memory_bytes for m in self._held())
        if budget is not None and in_use + model.memory_bytes > budget:
            return (f"it needs {model.memory_bytes / 2**30:.2f} GiB and {in_use / 2**30:.2f} GiB of the "
                    f"{budget / 2**30:.2f} GiB memory budget are held")
        return None

    async def _make_room(self, model: ServedModel) -> None:
        """Unload least recently used idle on-demand models until this one fits."""
        budget = self.memory_budget_bytes
        if budget is not None and model.memory_bytes > budget:
            raise unavailable(f"cannot load {model.name!r}: it needs {model.memory_bytes / 2**30:.2f} GiB, "
                              f"more than the whole memory budget ({budget / 2**30:.2f} GiB)",
                              retry_after_s=60)
        while (shortage := self._shortage(model)) is not None:
            now = time.monotonic()  # a model handed out this last second has a request on its way
            idle = sorted((m for m in self.loaded()
                           if m.entry.on_demand and not m.busy and now - m.last_used > 1),
                          key=lambda m: m.last_used)
            if not idle:
                raise unavailable(f"cannot load {model.name!r}: {shortage}, and none of the loaded models "
                                  "can be unloaded now (pinned or busy)", retry_after_s=5)
            await idle[0].unload()

    async def start(self) -> None:
        """Load the pinned models; then unload idle on-demand models as they time out."""
        for model in self.pinned:
            if (shortage := self._memory_shortage(model)) is not None:
                model.load_error = shortage
                continue
            with contextlib.suppress(Exception):  # recorded in load_error; the caller checks
                await model.load()

    async def unload_idle(self, now: float | None = None) -> list[str]:
        if self.idle_unload_s is None:
            return []
        now = time.monotonic() if now is None else now
        unloaded = []
        for model in self.loaded():
            if model.entry.on_demand and not model.busy and now - model.last_used >= self.idle_unload_s:
                await model.unload()
                unloaded.append(model.name)
        return unloaded

    async def shutdown(self) -> None:
        for model in self.loaded():
            await model.serving.aclose()
            await asyncio.to_thread(model.async_engine.shutdown)
