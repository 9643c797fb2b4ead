"""LoRAManager: which adapters are loaded, and each step's rows for each adapter.

Adapters load from disk the first time a request names them (its check) and stay in memory,
the least recently used that is not running evicted beyond `max_cpu_loras`. A waiting request
whose adapter was evicted is admitted once `prefetch` has read it again on a loader thread, and
the next adapter in line for a `max_loras` slot is read the same way, so the running batch keeps
decoding meanwhile. A request's prefix-cache hashes start from its adapter's identity, so KV
computed under one adapter is never reused under another or by the base model.
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
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype) -> None:
        self.model, self.config, self.dtype = model, config, dtype
        self.batch = LoRABatch(model.model.norm.weight.device)
        wrap_projections(model, self.batch)
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._requests: dict[str, LoRARequest] = {}  # every adapter seen, to reload evicted ones
        self._lock = threading.Lock()  # the server checks adapters off the engine thread
        self._pending: dict[str, Future] = {}  # adapters being read by the loader thread
        self._running: set[str] = set()  # the last step's adapters and those admitted since: evicted last
        self._last_step: set[str] = set()
        # each step's adapters by the tier that had them: the previous step's batch (on the GPU,
        # on the device), host memory, or the disk (read then, on the engine thread)
        self.hits = {"step": 0, "memory": 0, "disk": 0}
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lora-loader")
        self.num_loads = 0
        self.load_seconds = 0.0

    def check(self, request: LoRARequest) -> bytes:
        """Load (or find) the adapter, raising ValueError if it is unusable; returns the salt that
        starts its requests' prefix-cache hash chains."""
        known = self._requests.get(request.lora_name)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(f"adapter name {request.lora_name!r} is already used for {known.lora_path}")
        self.adapter(request)
        return hashlib.sha256(f"lora:{request.lora_name}:{request.lora_path}".encode()).digest()

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        with self._lock:
            adapter = self._loaded.get(request.lora_name)
            if adapter is not None:
                self._loaded.move_to_end(request.lora_name)
                return adapter
        started = time.perf_counter()
        adapter = load_adapter(request, self.model, self.config.max_lora_rank, self.dtype)
        with self._lock:
            self.load_seconds += time.perf_counter() - started
            self.num_loads += 1
            self._requests[request.lora_name] = request
            self._loaded[request.lora_name] = adapter
            while len(self._loaded) > self.config.max_cpu_loras:  # the least recently used not running
                evicted = next((name for name in self._loaded if name not in self._running), next(iter(self._loaded)))
                del self._loaded[evicted]
                logger.info("adapter %s evicted (max_cpu_loras=%d)", evicted, self.config.max_cpu_loras)
        return adapter

    def prefetch(self, request: LoRARequest) -> bool:
        """Whether a request of this adapter can run: the adapter is in memory (or failed to load:
        its step then says why). If not, start reading it on the loader thread (once)."""
        with self._lock:
            if request.lora_name in self._loaded:
                self._running.add(request.lora_name)  # about to run: not to be evicted before its step
                return True
            pending = self._pending.get(request.lora_name)
            if pending is None:
                self._pending[request.lora_name] = self._loader.submit(self.adapter, request)
                return False
        if not pending.done():
            return False
        with self._lock:
            self._pending.pop(request.lora_name, None)
        return pending.exception() is not None  # loaded and already evicted: read it again

    @property
    def num_loaded(self) -> int:
        return len(self._loaded)

    def set_rows(self, row_adapters: list[LoRARequest | None]) -> None:
        """Each flat-batch row's adapter (None: the base model) for the coming forward pass. The
        adapters in name order: the batch's stacks are rebuilt only when the set changes."""
        names = sorted({r.lora_name for r in row_adapters if r is not None})
        position = {name: i for i, name in enumerate(names)}
        for name in names:
            self.hits["step" if name in self._last_step else "memory" if name in self._loaded else "disk"] += 1
        adapters = [self.adapter(self._requests[name]) for name in position]
        with self._lock:
            self._running = self._last_step = set(position)
        self.batch.set(adapters, [-1 if r is None else position[r.lora_name] for r in row_adapters])

    def clear(self) -> None:
        self.batch.clear()
