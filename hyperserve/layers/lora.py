"""LoRA adapters applied per request at run time, never merged into the base weights.

With LoRA enabled, each projection (fused q/k/v, o, fused gate/up, down) is wrapped in a
LoRALinear: the base output, plus on each row its own adapter's x A^T (B scaling)^T for each
shard the adapter targets. Rows of other adapters and of the base model are untouched, so one
forward pass serves a batch that mixes them. LoRABatch stacks the step's adapters on the model's
device (the device tier of the adapter cache; LoRAManager keeps the host tier): on the GPU two
Triton kernels then apply each row's own adapter (layers/triton_lora.py); on the CPU it is two
matmuls per shard over all of them, masked, whatever their number; the native int4 decode layers
take them too (FusedDecode). The runner sets the batch before each pass.

Adapters are PEFT's format: adapter_config.json (r, lora_alpha, use_rslora, target_modules) and
adapter_model.safetensors (`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]); scaling is lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA.

Under tensor parallelism each rank reads the adapter itself and keeps its part, cut as the
projection is: B's rows where the output is split (q, k, v, gate, up), A's columns where the input
is (o, down), whose deltas then join the all-reduce of the base output.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hyperserve.common.lora_folders import is_file

# PEFT's module name -> (our module, shard of it; None: every shard, the module fused in the model
# as Phi-3's are, its B holding each shard's rows in turn)
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", 0), "qkv_proj": ("self_attn.qkv_proj", None),
           "gate_up_proj": ("mlp.gate_up_proj", None)}
WRAPPED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_KEY = re.compile(r".*layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight")


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with, as vLLM names it: a name (what clients send as `model`),
    a positive integer id, and the adapter's directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(eq=False)  # compared as objects: a name loaded again is another adapter
class LoRAAdapter:
    name: str
    path: str
    rank: int
    dtype: torch.dtype
    digest: bytes  # SHA-256 of its config and weights as read: its KV's identity in the prefix cache
    # (layer, our module) -> per shard (A [r, in], B * scaling [out, r]) or None where not targeted
    weights: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]] = \
        field(default_factory=dict)
    _native: dict[int, list[torch.Tensor]] = field(default_factory=dict, repr=False)

    def native(self, index: int, layer: nn.Module) -> list[torch.Tensor]:
        """Its weights on one layer as the native decode layer takes them (kernels/cpu_ops.cpp,
        LoRAWeights): per projection, A of every shard stacked [S * r, in] and B^T [r, out] with each
        shard's B^T in its own columns, stored in tiles of NATIVE_TILE columns, in its dtype; empty
        tensors where it targets none. Built once."""
        if index not in self._native:
            tensors = []
            for name in WRAPPED:
                shards = self.weights.get((index, name))
                if shards is None:
                    tensors += [torch.empty(0), torch.empty(0)]
                    continue
                sizes, in_features = _shard_sizes(layer, name), layer.get_submodule(name).in_features
                a = torch.zeros(len(sizes) * self.rank, in_features, dtype=self.dtype)
                b = torch.zeros(self.rank, sum(sizes), dtype=self.dtype)
                for shard, pair in enumerate(shards):
                    if pair is not None:
                        offset = sum(sizes[:shard])
                        a[shard * self.rank : (shard + 1) * self.rank] = pair[0]
                        b[:, offset : offset + sizes[shard]] = pair[1].T
                tensors += [a, _tiled(b, sizes)]
            self._native[index] = tensors
        return self._native[index]

    @property
    def num_bytes(self) -> int:
        """Its weights in memory, the native decode layers' copy included once built."""
        return (sum(t.nbytes for shards in self.weights.values() for ab in shards if ab for t in ab)
                + sum(t.nbytes for tensors in self._native.values() for t in tensors))


def load_adapter(request: LoRARequest, model: nn.Module, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check a PEFT adapter against the base model; ValueError saying what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    directory = Path(request.lora_path)
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    for path in (config_path, weights_path):
        if not is_file(path):
            raise ValueError(f"adapter {request.lora_name!r}: {path} is missing (a PEFT adapter "
                             "directory has adapter_config.json and adapter_model.safetensors)")
    try:
        config_bytes, weights_bytes = config_path.read_bytes(), weights_path.read_bytes()
        config, tensors = json.loads(config_bytes), load(weights_bytes)
    except (ValueError, SafetensorError, OSError) as error:
        raise ValueError(f"adapter {request.lora_name!r}: cannot read it: {error}") from error
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", config.get("r", 0)))
    if not 1 <= rank <= max_rank:
        raise ValueError(f"adapter {request.lora_name!r}: rank {rank} is outside 1..{max_rank} "
                         "(max_lora_rank)")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or match.group(2) not in TARGETS:
            experts = " (a mixture of experts' experts take no adapters yet)" if ".experts" in key else ""
            raise ValueError(f"adapter {request.lora_name!r}: {key!r} is not a LoRA weight of a supported "
                             f"module ({', '.join(TARGETS)}){experts}")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"adapter {request.lora_name!r}: per-module ranks (rank_pattern, alpha_pattern) "
                         "are not supported")
    digest = hashlib.sha256(len(config_bytes).to_bytes(8, "little"))
    digest.update(config_bytes)
    digest.update(weights_bytes)
    adapter = LoRAAdapter(request.lora_name, request.lora_path, rank, dtype, digest.digest())
    layers = model.model.layers
    for (layer, name), pair in sorted(pairs.items()):
        module_name, shard = TARGETS[name]
        if layer >= len(layers) or set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {request.lora_name!r}: layer {layer} {name} does not fit this model "
                             f"({len(layers)} layers) or lacks lora_A or lora_B")
        if not _has(layers[layer], module_name):
            what = ("attention is DeepSeek's latent attention" if module_name.startswith("self_attn.")
                    else "MLP is a mixture of experts")
            raise ValueError(f"adapter {request.lora_name!r}: layer {layer}'s {what}, whose {name} LoRA "
                             "does not run yet")
        target = layers[layer].get_submodule(module_name)
        sizes = _shard_sizes(layers[layer], module_name)
        a, b = pair["A"], pair["B"]
        if model.tp.size > 1:
            a, b = _rank_part(model, name, a, b)
        rows = sum(sizes) if shard is None else sizes[shard]
        if a.shape != (rank, target.in_features) or b.shape != (rows, rank):
            raise ValueError(f"adapter {request.lora_name!r}: layer {layer} {name} has A {tuple(a.shape)} "
                             f"and B {tuple(b.shape)}; this model needs ({rank}, {target.in_features}) and "
                             f"({rows}, {rank}): it was trained for another base model")
        shards = adapter.weights.setdefault((layer, module_name), [None] * len(sizes))
        a = a.to(dtype).contiguous()
        for index, part in [(shard, b)] if shard is not None else enumerate(b.split(sizes)):
            shards[index] = (a, (part.float() * scaling).to(dtype).contiguous())
    if not adapter.weights:
        raise ValueError(f"adapter {request.lora_name!r} holds no LoRA weights")
    return adapter


def _rank_part(model: nn.Module, name: str, a: torch.Tensor, b: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of a PEFT module `name`: A's columns of an input split by rank (o, down),
    else B's rows of the output's split (checked for fit after, as whole adapters are)."""
    from hyperserve.models.llama import rank_slice

    def part(tensor: torch.Tensor) -> torch.Tensor:
        return rank_slice(model.tp, model.config, name, "weight", tensor, model.config.intermediate_size)

    return (part(a), b) if name in ("o_proj", "down_proj") else (a, part(b))


NATIVE_TILE = 64  # kLoRATile in kernels/cpu_ops.cpp


def _tiled(b: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """B^T [r, out] with each shard's columns cut into tiles of NATIVE_TILE (the last of a shard
    narrower), each tile's [r, width] contiguous, tiles in column order; shape kept [r, out]."""
    tiles, start = [], 0
    for size in sizes:
        for first in range(start, start + size, NATIVE_TILE):
            tiles.append(b[:, first : min(first + NATIVE_TILE, start + size)].reshape(-1))
        start += size
    return torch.cat(tiles).view(b.shape)


def _shard_sizes(layer: nn.Module, name: str) -> list[int]:
    """Output sizes of a fused projection's parts (q, k, v or gate, up), as its parent module says."""
    if name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        return list(layer.get_submodule(name.split(".")[0]).shard_sizes)
    return [layer.get_submodule(name).out_features]


class LoRABatch:
    """This step's adapters and which rows use which, set by the runner before each forward pass.

    Every adapter's A (zero-padded to the step's largest rank) is stacked, per projection shard,
    into one [n * r, in] matrix and its B into one [n * r, out]: a shard's delta for the whole
    batch is then two matmuls, x A_all^T masked to each row's own adapter columns, times B_all,
    however many adapters share the step (an adapter's part of h is zero on other rows). The
    stacks are kept while the same adapters run together, as consecutive decode steps do."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        # tests may ask for triton on the CPU
        self.kernel = "triton" if self.device.type == "cuda" else "torch"
        self.adapters: list[LoRAAdapter] = []
        self.rows: torch.Tensor | None = None  # [T] each row's position in `adapters`, -1 for the base model
        self.mask: torch.Tensor | None = None  # [T, n * r] 1 where the row's adapter owns the column
        self._stacks: dict[tuple, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._native: dict[int, list[torch.Tensor]] = {}
        self._stacked: tuple[LoRAAdapter, ...] = ()  # the adapters the stacks hold

    def set(self, adapters: list[LoRAAdapter], row_adapter: list[int]) -> None:
        """row_adapter: each row's position in `adapters`, -1 for the base model."""
        if tuple(adapters) != self._stacked:
            self._stacks, self._native, self._stacked = {}, {}, tuple(adapters)
        self.adapters = adapters
        self.rows = torch.tensor(row_adapter, dtype=torch.long)
        if self.kernel == "triton":
            self.rows, self.mask = self.rows.to(self.device), None
            return
        if len(adapters) == 1 and all(i == 0 for i in row_adapter):
            self.mask = None  # every row runs the one adapter
            return
        rank = max(a.rank for a in adapters)
        columns = torch.arange(len(adapters)).repeat_interleave(rank)
        self.mask = (self.rows[:, None] == columns[None, :]).to(self.device, adapters[0].dtype)

    def clear(self) -> None:
        self.adapters, self.rows, self.mask = [], None, None

    def native(self, index: int, layer: nn.Module) -> list[torch.Tensor]:
        """The step's adapters' weights on one layer for the native decode layer, in their order."""
        if index not in self._native:
            self._native[index] = [t for adapter in self.adapters for t in adapter.native(index, layer)]
        return self._native[index]

    def stacked(self, key: tuple[int, str], shard: int, out_size: int, in_size: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A_all [n * r, in], B_all [n * r, out]) of one projection shard; None if no adapter has it."""
        cache_key = (key, shard)
        if cache_key not in self._stacks:
            rank = max(a.rank for a in self.adapters)
            parts = [a.weights[key][shard] if key in a.weights else None for a in self.adapters]
            if not any(parts):
                self._stacks[cache_key] = None
            else:
                dtype = self.adapters[0].dtype
                a_all = torch.zeros(len(parts) * rank, in_size, dtype=dtype, device=self.device)
                b_all = torch.zeros(len(parts) * rank, out_size, dtype=dtype, device=self.device)
                for i, part in enumerate(parts):
                    if part:
                        a, b = part
                        a_all[i * rank : i * rank + a.shape[0]] = a
                        b_all[i * rank : i * rank + a.shape[0]] = b.T
                self._stacks[cache_key] = (a_all, b_all)
        return self._stacks[cache_key]


class LoRALinear(nn.Module):
    """A projection plus the step's adapter deltas on their own rows."""

    def __init__(self, base: nn.Module, layer: int, name: str, sizes: list[int], batch: LoRABatch) -> None:
        super().__init__()
        self.base, self.key, self.batch = base, (layer, name), batch
        self.in_features, self.out_features = base.in_features, base.out_features
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if not self.batch.adapters:
            return y
        for shard, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            stacked = self.batch.stacked(self.key, shard, size, self.in_features)
            if stacked is None:
                continue
            a_all, b_all = stacked
            if self.batch.kernel == "triton":
                from hyperserve.layers.triton_lora import lora_expand, lora_shrink

                n = len(self.batch.adapters)
                h = lora_shrink(x, a_all.view(n, -1, self.in_features), self.batch.rows)
                lora_expand(h, b_all.view(n, -1, size), self.batch.rows, y[:, offset : offset + size])
                continue
            h = x.to(a_all.dtype) @ a_all.T  # [T, n * r]
            if self.batch.mask is not None:
                h = h * self.batch.mask
            y[:, offset : offset + size] += (h @ b_all).to(y.dtype)
        return y


def wrap_projections(model: nn.Module, batch: LoRABatch) -> None:
    """Put every projection of every layer behind a LoRALinear sharing `batch`."""
    for index, layer in enumerate(model.model.layers):
        for name in filter(lambda name: _has(layer, name), WRAPPED):  # a mixture of experts has no mlp.*_proj
            parent_name, _, leaf = name.rpartition(".")
            parent = layer.get_submodule(parent_name)
            wrapped = LoRALinear(getattr(parent, leaf), index, name, _shard_sizes(layer, name), batch)
            setattr(parent, leaf, wrapped)


def _has(layer: nn.Module, name: str) -> bool:
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def unwrapped(module: nn.Module) -> nn.Module:
    return module.base if isinstance(module, LoRALinear) else module
