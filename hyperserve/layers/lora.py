"""LoRA adapters applied per request at run time, never merged into the base weights.

With LoRA enabled, each projection (fused q/k/v, o, fused gate/up, down) is wrapped in a
LoRALinear: the base output, plus on each row its own adapter's x A^T (B scaling)^T for each
shard the adapter targets. Rows of other adapters and of the base model are untouched, so one
forward pass serves a batch that mixes them (LoRABatch stacks the step's adapters so that this
is two matmuls per shard, whatever their number). The runner sets the batch before each pass.

Adapters are PEFT's format: adapter_config.json (r, lora_alpha, use_rslora, target_modules) and
adapter_model.safetensors (`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]); scaling is lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

# PEFT's module name -> (our module, shard of it)
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", 0)}
WRAPPED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_KEY = re.compile(r".*layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight")


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs with, as vLLM names it: a name (what clients send as `model`),
    a positive integer id, and the adapter's directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    dtype: torch.dtype
    # (layer, our module) -> per shard (A [r, in], B * scaling [out, r]) or None where not targeted
    weights: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor] | None]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for shards in self.weights.values() for ab in shards if ab
                   for t in ab)


def load_adapter(request: LoRARequest, model: nn.Module, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check a PEFT adapter against the base model; ValueError saying what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(request.lora_path)
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise ValueError(f"adapter {request.lora_name!r}: {path} is missing (a PEFT adapter directory has "
                             "adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads(config_path.read_text())
        tensors = load_file(weights_path)
    except (ValueError, SafetensorError, OSError) as error:
        raise ValueError(f"adapter {request.lora_name!r}: cannot read it: {error}") from error
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", config.get("r", 0)))
    if not 1 <= rank <= max_rank:
        raise ValueError(f"adapter {request.lora_name!r}: rank {rank} is outside 1..{max_rank} (max_lora_rank)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"adapter {request.lora_name!r}: per-module ranks (rank_pattern, alpha_pattern) "
                         "are not supported")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or match.group(2) not in TARGETS:
            raise ValueError(f"adapter {request.lora_name!r}: {key!r} is not a LoRA weight of a supported "
                             f"module ({', '.join(TARGETS)})")
        pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    adapter = LoRAAdapter(request.lora_name, request.lora_path, rank, dtype)
    layers = model.model.layers
    for (layer, name), pair in sorted(pairs.items()):
        module_name, shard = TARGETS[name]
        if layer >= len(layers) or set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {request.lora_name!r}: layer {layer} {name} does not fit this model "
                             f"({len(layers)} layers) or lacks lora_A or lora_B")
        target = layers[layer].get_submodule(module_name)
        sizes = _shard_sizes(layers[layer], module_name)
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, target.in_features) or b.shape != (sizes[shard], rank):
            raise ValueError(f"adapter {request.lora_name!r}: layer {layer} {name} has A {tuple(a.shape)} and "
                             f"B {tuple(b.shape)}; this model needs ({rank}, {target.in_features}) and "
                             f"({sizes[shard]}, {rank}): it was trained for another base model")
        shards = adapter.weights.setdefault((layer, module_name), [None] * len(sizes))
        shards[shard] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    if not adapter.weights:
        raise ValueError(f"adapter {request.lora_name!r} holds no LoRA weights")
    return adapter


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

    def __init__(self) -> None:
        self.adapters: list[LoRAAdapter] = []
        self.mask: torch.Tensor | None = None  # [T, n * r] 1 where the row's adapter owns the column
        self._stacks: dict[tuple, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._names: tuple[str, ...] = ()

    def set(self, adapters: list[LoRAAdapter], row_adapter: list[int]) -> None:
        """row_adapter: each row's position in `adapters`, -1 for the base model."""
        names = tuple(a.name for a in adapters)
        if names != self._names:
            self._stacks, self._names = {}, names
        self.adapters = adapters
        if len(adapters) == 1 and all(i == 0 for i in row_adapter):
            self.mask = None  # every row runs the one adapter
            return
        rank = max(a.rank for a in adapters)
        columns = torch.arange(len(adapters)).repeat_interleave(rank)
        self.mask = (torch.tensor(row_adapter)[:, None] == columns[None, :]).to(adapters[0].dtype)

    def clear(self) -> None:
        self.adapters, self.mask = [], None

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
                a_all = torch.zeros(len(parts) * rank, in_size, dtype=dtype)
                b_all = torch.zeros(len(parts) * rank, out_size, dtype=dtype)
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
            h = x.to(a_all.dtype) @ a_all.T  # [T, n * r]
            if self.batch.mask is not None:
                h = h * self.batch.mask
            y[:, offset : offset + size] += (h @ b_all).to(y.dtype)
        return y


def wrap_projections(model: nn.Module, batch: LoRABatch) -> None:
    """Put every projection of every layer behind a LoRALinear sharing `batch`."""
    for index, layer in enumerate(model.model.layers):
        for name in WRAPPED:
            parent_name, _, leaf = name.rpartition(".")
            parent = layer.get_submodule(parent_name)
            setattr(parent, leaf, LoRALinear(getattr(parent, leaf), index, name, _shard_sizes(layer, name), batch))


def unwrapped(module: nn.Module) -> nn.Module:
    return module.base if isinstance(module, LoRALinear) else module
