"""LoRAManager: which adapters are loaded, and each step's rows for each adapter.

Adapters load from disk the first time a request names them (its check) and stay in memory,
the least recently used that is not running evicted beyond `max_cpu_loras`. A waiting request
whose adapter was evicted is admitted once `prefetch` has read it again on a loader thread, and
the next adapter in line for a `max_loras` slot is read the same way, so the running batch keeps
decoding meanwhile. An adapter is known by its whole LoRARequest (name, id and directory): the
server gives each load a new id, so an adapter loaded again, under its old name or from its old
directory, is read afresh while requests of the old one finish with it. A request's prefix-cache
hashes start from its adapter's content digest, so KV computed under one adapter is never reused
under another or by the base model.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hyperserve.config import LoRAConfig
from hyperserve.layers.lora import LoRAAdapter, LoRABatch, LoRARequest, load_adapter, wrap_projections

logger = logging.getLogger("hyperserve.lora")


class LoRAManager:
    @classmethod
    def of(cls, model: torch.nn.Module, config: LoRAConfig) -> LoRAManager | None:
        """The manager of a model's adapters, in its dtype; None where LoRA is off."""
        return cls(model, config, model.model.norm.weight.dtype) if config.enable_lora else None

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype) -> None:
        self.model, self.config, self.dtype = model, config, dtype
        self.batch = LoRABatch(model.model.norm.weight.device)
        wrap_projections(model, self.batch)
        self._loaded: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()  # the server checks adapters off the engine thread
        self._pending: dict[LoRARequest, Future] = {}  # adapters being read by the loader thread
        self._running: set[LoRARequest] = set()  # the last step's adapters and those admitted since
        self._last_step: set[LoRARequest] = set()
        self._forgotten: set[LoRARequest] = set()  # no longer served: dropped once their requests end
        # each step's adapters by the tier that had them: the previous step's batch (on the GPU,
        # on the device), host memory, or the disk (read then, on the engine thread)
        self.hits = {"step": 0, "memory": 0, "disk": 0}
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lora-loader")
        self.num_loads = 0
        self.load_seconds = 0.0

    def check(self, request: LoRARequest) -> bytes:
        """Load (or find) the adapter, raising ValueError if it is unusable; returns the salt that
        starts its requests' prefix-cache hash chains."""
        return hashlib.sha256(b"lora:" + self.adapter(request).digest).digest()

    def forget(self, request: LoRARequest) -> None:
        """The adapter is no longer served: out of memory now or, where the last step with adapters
        ran it, at the next such step without it (its running requests finish with it)."""
        with self._lock:
            self._pending.pop(request, None)
            if request in self._running:
                self._forgotten.add(request)
            else:
                self._loaded.pop(request, None)

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        with self._lock:
            adapter = self._loaded.get(request)
            if adapter is not None:
                self._loaded.move_to_end(request)
                return adapter
        started = time.perf_counter()
        adapter = load_adapter(request, self.model, self.config.max_lora_rank, self.dtype)
        with self._lock:
            self.load_seconds += time.perf_counter() - started
            self.num_loads += 1
            self._loaded[request] = adapter
            while len(self._loaded) > self.config.max_cpu_loras:  # the least recently used not running
                evicted = next((r for r in self._loaded if r not in self._running), next(iter(self._loaded)))
                del self._loaded[evicted]
                logger.info("adapter %s evicted (max_cpu_loras=%d)", evicted.lora_name,
                            self.config.max_cpu_loras)
        return adapter

    def prefetch(self, request: LoRARequest) -> bool:
        """Whether a request of this adapter can run: the adapter is in memory (or failed to load:
        its step then says why). If not, start reading it on the loader thread (once)."""
        with self._lock:
            if request in self._loaded:
                self._running.add(request)  # about to run: not to be evicted before its step
                return True
            pending = self._pending.get(request)
            if pending is None:
                self._pending[request] = self._loader.submit(self.adapter, request)
                return False
        if not pending.done():
            return False
        with self._lock:
            self._pending.pop(request, None)
        return pending.exception() is not None  # loaded and already evicted: read it again

    @property
    def num_loaded(self) -> int:
        return len(self._loaded)

    def set_rows(self, row_adapters: list[LoRARequest | None]) -> None:
        """Each flat-batch row's adapter (None: the base model) for the coming forward pass. The
        adapters in one order (name, id): the batch's stacks are rebuilt only when the set changes."""
        requests = sorted({r for r in row_adapters if r is not None},
                          key=lambda r: (r.lora_name, r.lora_int_id))
        position = {request: i for i, request in enumerate(requests)}
        for r in requests:
            self.hits["step" if r in self._last_step else "memory" if r in self._loaded else "disk"] += 1
        adapters = [self.adapter(r) for r in requests]
        with self._lock:
            self._running = self._last_step = set(position)
            for done in self._forgotten - self._running:
                self._loaded.pop(done, None)
            self._forgotten &= self._running
        self.batch.set(adapters, [-1 if r is None else position[r] for r in row_adapters])

    def clear(self) -> None:
        self.batch.clear()
