"""The Llama family decoder: Llama 2/3, Mistral (sliding window), Qwen2 (QKV bias), Qwen3 (QK
norms), SmolLM2, SmolLM3 (layers without rotary), Granite (its multipliers folded into the weights
as they load), Phi-3 and Phi-4 (whose checkpoints fuse q/k/v and gate/up as these layers do), the
mixture-of-experts members Mixtral, Qwen3-MoE and Qwen2-MoE (layers/moe.py in place of the MLP),
and DeepSeek-V2 and V3 (their latent attention, models/deepseek.py, and experts).

Inputs are flat: every scheduled token of every sequence in one [T] tensor with its position, no
padding. Q/K/V and gate/up projections are fused into one matmul each; `load_weight` takes
Hugging Face tensor names and writes each shard in place.

Under tensor parallelism (distributed/group.py) each rank builds the layers of its own heads and
its own run of the MLP's width (of every expert's, in a mixture), `load_weight` keeps only that
rank's slice of each tensor, and o and down (a mixture: its weighted sum of experts) end with an
all-reduce; the embedding and LM head hold the rank's range of the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from hyperserve.distributed.group import TensorParallel
from hyperserve.layers import gemv_decode, on_triton
from hyperserve.layers.attention import AttentionBackend, AttentionMetadata, KVCache
from hyperserve.layers.linear import Linear
from hyperserve.layers.moe import SparseMoE
from hyperserve.layers.norm import RMSNorm
from hyperserve.layers.rotary import RotaryEmbedding
from hyperserve.models.deepseek import LATENT_TYPES, LatentAttention, grouped_routing, latent_width
from hyperserve.models.gpt_oss import GPT_OSS_TYPES, ClampedSwiGLU

QK_NORM_TYPES = ("qwen3", "qwen3_moe")
QWEN_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")  # sliding window only with use_sliding_window

# HF projection name -> (our fused parameter, shard index)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    softcap = None  # no cap on the attention scores (Gemma 2's attention has one: models/gemma.py)

    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallel, use_rope: bool = True, full_attention: bool = False):
        """use_rope: False for SmolLM3's NoPE layers, whose q and k are not rotated. full_attention:
        a layer that attends past the window of a model whose other layers have one (GPT-OSS's)."""
        super().__init__()
        heads = tp.head_slice(config.num_attention_heads, config.num_key_value_heads)
        self.num_heads = heads.num_heads  # this rank's
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = head_dim_of(config)
        self.tp = tp
        self.scale = config.attention_multiplier if config.model_type == "granite" else self.head_dim**-0.5
        self.shard_sizes = [
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        ]
        bias = (config.model_type == "qwen2" or getattr(config, "qkv_bias", False)  # Qwen2-MoE's
                or getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(config.hidden_size, sum(self.shard_sizes), bias=bias)
        self.o_proj = Linear(
            self.num_heads * self.head_dim, config.hidden_size,
            bias=getattr(config, "attention_bias", False),
        )
        # q and k rotate together
        self.qk_v_sizes = [self.shard_sizes[0] + self.shard_sizes[1], self.shard_sizes[2]]
        # Qwen3 RMS-normalises each head of q and k before rotating them
        self.q_norm = self.k_norm = None
        if config.model_type in QK_NORM_TYPES:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # GPT-OSS's attention sinks: a learned logit per head in each row's softmax, a key with no value
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.model_type in GPT_OSS_TYPES else None
        self.full_attention = full_attention
        self.rotary = rotary if use_rope else None
        self.backend = backend

    @property
    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q's norm weight, k's, eps) where each head is normalised before rotating (Qwen3)."""
        return None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def forward(self, cos_sin, x, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        if self.full_attention and meta.full_attention is not None:
            meta = meta.full_attention
        out = self.attend(cos_sin, self.qkv_proj(x), kv_cache, meta)  # x [T, hidden]
        return self.tp.all_reduce(self.o_proj(out.flatten(1)))

    def attend(self, cos_sin, qkv: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """The attention output [T, H, D] for the fused projection's output qkv [T, (H + 2 Hkv) D]."""
        if self.rotary is not None and (out := rotated_attention(self, cos_sin, qkv, kv_cache, meta,
                                                                 self.qk_norm)) is not None:
            return out
        qk, v = qkv.split(self.qk_v_sizes, dim=-1)
        qk = qk.unflatten(-1, (-1, self.head_dim))  # [T, H + Hkv, D]
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if self.rotary is not None:
            qk = self.rotary(cos_sin, qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        v = v.unflatten(-1, (-1, self.head_dim))  # [T, Hkv, D]
        return self.backend(q, k, v, kv_cache, meta, self.scale, sinks=self.sinks)


def rotated_attention(attn: nn.Module, cos_sin, qkv: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                      qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None) -> torch.Tensor | None:
    """On CUDA, q and k rotated (after their per-head norms, where given) and the new K/V written by
    one Triton kernel straight from qkv, then attention over the cache: [T, H, D]. None where that
    kernel does not apply (off CUDA, heads whose width is not a power of two, or a rotation over
    part of each head). `attn` is a model's attention module (its heads, rotary, backend, scale,
    softcap and sinks)."""
    if not (on_triton(qkv) and attn.head_dim & (attn.head_dim - 1) == 0
            and attn.rotary.rotary_dim == attn.head_dim):
        return None
    from hyperserve.layers.triton_elementwise import rotary_and_cache

    q, k, v = rotary_and_cache(qkv, cos_sin, meta.slot_mapping, kv_cache, attn.num_heads, attn.num_kv_heads,
                               qk_norm)
    return attn.backend(q, k, v, kv_cache, meta, attn.scale, kv_written=True, softcap=attn.softcap,
                        sinks=attn.sinks)


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel,
                 intermediate_size: int | None = None, reduce: bool = True) -> None:
        """intermediate_size: an expert's, where it differs from the config's dense MLP. reduce:
        False for an expert, whose mixture adds up the ranks' parts once for all its experts."""
        super().__init__()
        start, end = tp.width(intermediate_size or config.intermediate_size)
        self.intermediate_size = end - start  # this rank's
        self.shard_sizes = [self.intermediate_size, self.intermediate_size]
        oss = config.model_type in GPT_OSS_TYPES  # biased experts, their gate clamped
        bias = getattr(config, "mlp_bias", False) or oss
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=bias)
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, bias=bias)
        self.activation = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit) if oss else silu_and_mul
        self.tp = tp if reduce else TensorParallel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.activation(self.gate_up_proj(x))))


def is_sparse_layer(config: PretrainedConfig, index: int) -> bool:
    """Whether layer `index` routes its tokens to experts (Qwen3-MoE may keep some layers dense,
    DeepSeek its first first_k_dense_replace)."""
    if config.model_type in ("mixtral", *GPT_OSS_TYPES):
        return True
    if config.model_type in LATENT_TYPES:
        return index >= config.first_k_dense_replace
    if (config.model_type not in ("qwen2_moe", "qwen3_moe") or config.num_experts == 0
            or index in (config.mlp_only_layers or [])):
        return False
    return (index + 1) % config.decoder_sparse_step == 0


def expert_width(config: PretrainedConfig) -> int:
    """A routed expert's intermediate size."""
    if config.model_type in ("mixtral", *GPT_OSS_TYPES):
        return config.intermediate_size
    return config.moe_intermediate_size


def shared_expert_width(config: PretrainedConfig) -> int | None:
    """The intermediate size of the expert every token runs (Qwen2-MoE's; DeepSeek's n_shared_experts
    as one MLP); None: none."""
    if config.model_type in LATENT_TYPES:
        return config.moe_intermediate_size * config.n_shared_experts if config.n_shared_experts else None
    return config.shared_expert_intermediate_size if config.model_type == "qwen2_moe" else None


def mlp_width(config: PretrainedConfig, name: str) -> int:
    """The intermediate size of the MLP checkpoint tensor `name` belongs to: a routed expert's,
    the shared expert's, or the dense MLP's."""
    if ".shared_expert." in name:
        return shared_expert_width(config)
    return expert_width(config) if ".experts." in name else config.intermediate_size


def sparse_moe(config: PretrainedConfig, tp: TensorParallel) -> SparseMoE:
    grouped = None
    if config.model_type in ("mixtral", *GPT_OSS_TYPES):  # top-k weights always renormalised
        num_experts, renormalize = config.num_local_experts, True
    elif config.model_type in LATENT_TYPES:  # V2's weights never renormalised (as transformers')
        num_experts, grouped = config.n_routed_experts, grouped_routing(config)
        renormalize = config.model_type == "deepseek_v3" and config.norm_topk_prob
    else:
        num_experts, renormalize = config.num_experts, config.norm_topk_prob
    shared_width = shared_expert_width(config)
    shared = None if shared_width is None else LlamaMLP(config, tp, shared_width, reduce=False)
    return SparseMoE(config.hidden_size, num_experts, config.num_experts_per_tok, renormalize,
                     lambda: LlamaMLP(config, tp, expert_width(config), reduce=False), tp, shared,
                     gated_shared_expert=config.model_type == "qwen2_moe", grouped=grouped,
                     router_bias=config.model_type in GPT_OSS_TYPES)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, rotary, backend, tp, index: int) -> None:
        super().__init__()
        rope = getattr(config, "no_rope_layers", None)  # SmolLM3: 1 where a layer rotates, 0 where not
        if config.model_type in LATENT_TYPES:
            self.self_attn = LatentAttention(config, rotary, backend, tp)
        else:
            kinds = getattr(config, "layer_types", None)
            self.self_attn = LlamaAttention(
                config, rotary, backend, tp, use_rope=rope is None or bool(rope[index]),
                full_attention=bool(kinds) and kinds[index] == "full_attention")
        self.mlp = sparse_moe(config, tp) if is_sparse_layer(config, index) else LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, cos_sin, hidden, residual, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): each residual add happens in
        the next norm, as one kernel on CUDA. The first layer takes residual None."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(cos_sin, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_position: int,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(tp.vocab_shard(config.vocab_size), config.hidden_size)
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_position)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary, backend, tp, index)
            for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, backend: AttentionBackend, max_position: int,
                 tp: TensorParallel | None = None):
        super().__init__()
        self.config = config
        self.attention_backend = backend
        self.tp = tp or TensorParallel()
        self.vocab_shard = self.tp.vocab_shard(config.vocab_size)
        self.model = LlamaModel(config, backend, max_position, self.tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (
            None if self.tie_word_embeddings
            else Linear(config.hidden_size, self.vocab_shard, bias=False)
        )
        # which layers attend through the sliding window: every one, or (a config with layer_types:
        # GPT-OSS's alternate, Qwen2's from max_window_layers on) those its layer_types say
        window = _config_window(config)
        self.window_layers = [window is not None and not layer.self_attn.full_attention
                              for layer in self.model.layers]
        self.sliding_window = window if any(self.window_layers) else None  # None: no layer has one
        # layers with the window and layers without it: the runner adds unwindowed metadata
        self.interleaves_full_attention = any(self.window_layers) and not all(self.window_layers)

    @property
    def has_experts(self) -> bool:
        """A mixture of experts: its steps pick experts on the host, so they are neither compiled
        nor captured in CUDA graphs."""
        return any(isinstance(layer.mlp, SparseMoE) for layer in self.model.layers)

    embedding_multiplier: float | None = None  # the embeddings as looked up (Gemma scales its own)
    final_logit_softcap: float | None = None  # logits as the head gives them (Gemma 2 caps its own)

    def reset_rotary(self) -> None:
        """Fill the rotary tables (the model is built on the meta device, so this runs after)."""
        self.model.rotary.reset_cache()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], before the final norm
        hidden = self.embed(input_ids)
        cos_sin = self.model.rotary.cos_sin_for(positions, hidden.dtype)  # once per step, for every layer
        if gemv_decode.takes(self, hidden):  # one token on CUDA: six kernels a layer
            return gemv_decode.forward(self.model.layers, cos_sin, hidden, kv_caches, meta)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(cos_sin, hidden, residual, kv_cache, meta)
        return hidden + residual

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]."""
        return embed_vocab_parallel(self.tp, self.model.embed_tokens, self.vocab_shard, input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] of the positions to sample -> float32 logits [S, vocab]."""
        hidden = self.model.norm(hidden)
        if self.lm_head is None:  # tied, unquantized
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        return self.tp.all_gather(logits)[:, : self.config.vocab_size]

    def load_weight(self, name: str, tensor: torch.Tensor) -> str:
        """Copy one checkpoint tensor (Hugging Face name) into place, this rank's slice of it under
        tensor parallelism; returns the parameter name."""
        if name == "lm_head.weight" and self.lm_head is None:
            return "model.embed_tokens.weight"  # tied: the embedding already holds it
        if self.config.model_type == "granite":
            tensor = tensor * granite_factor(self.config, name, self.tie_word_embeddings)
        if ".self_attn." in name and self.config.model_type in LATENT_TYPES:
            layer, _, leaf = name.partition(".self_attn.")
            attention = self.get_submodule(f"{layer}.self_attn")
            return f"{layer}.self_attn.{attention.load_weight(leaf, tensor)}"
        name = name.replace(".shared_experts.", ".shared_expert.")  # DeepSeek's
        module_name, _, leaf = name.rpartition(".")
        parent, _, proj = module_name.rpartition(".")
        if self.tp.size > 1:
            tensor = rank_slice(self.tp, self.config, proj, leaf, tensor, mlp_width(self.config, name))
        if proj in _FUSED:
            fused, shard = _FUSED[proj]
            target = self.get_parameter(f"{parent}.{fused}.{leaf}")
            sizes = self.get_submodule(parent).shard_sizes
            offset = sum(sizes[:shard])
            target.data[offset : offset + sizes[shard]].copy_(tensor)
            return f"{parent}.{fused}.{leaf}"
        self.get_parameter(name).data.copy_(tensor)
        return name


def _config_window(config: PretrainedConfig) -> int | None:
    """The config's sliding window (Qwen's only with use_sliding_window)."""
    if config.model_type in QWEN_TYPES and not getattr(config, "use_sliding_window", False):
        return None
    return getattr(config, "sliding_window", None)


def embed_vocab_parallel(tp: TensorParallel, embedding: nn.Module, vocab_shard: int,
                         input_ids: torch.Tensor) -> torch.Tensor:
    """[T] -> [T, hidden] from an embedding of this rank's vocab_shard ids: each rank embeds the ids
    in its range, zeros elsewhere, and the all-reduce adds them up."""
    if tp.size == 1:
        return embedding(input_ids)
    local = input_ids - tp.rank * vocab_shard
    inside = (local >= 0) & (local < vocab_shard)
    hidden = embedding(torch.where(inside, local, 0)).masked_fill(~inside.unsqueeze(-1), 0)
    return tp.all_reduce(hidden)


def rank_slice(tp: TensorParallel, config: PretrainedConfig, proj: str, leaf: str, tensor: torch.Tensor,
               mlp_width: int) -> torch.Tensor:
    """This rank's part of a full checkpoint tensor of projection `proj` (or the embedding), as
    the layers built with `tp` hold it; mlp_width: the intermediate size of the MLP it belongs to."""
    d, heads = head_dim_of(config), tp.head_slice(config.num_attention_heads, config.num_key_value_heads)
    rows = {"q_proj": (heads.q_start * d, (heads.q_start + heads.num_heads) * d),
            "k_proj": (heads.kv_start * d, (heads.kv_start + heads.num_kv_heads) * d),
            "v_proj": (heads.kv_start * d, (heads.kv_start + heads.num_kv_heads) * d),
            "gate_proj": tp.width(mlp_width),
            "up_proj": tp.width(mlp_width)}
    columns = {"o_proj": rows["q_proj"], "down_proj": rows["gate_proj"]}
    if proj in ("qkv_proj", "gate_up_proj"):  # fused in the checkpoint (Phi-3): each part's slice, joined
        parts = ("q_proj", "k_proj", "v_proj") if proj == "qkv_proj" else ("gate_proj", "up_proj")
        sizes = ([config.num_attention_heads * d] + [config.num_key_value_heads * d] * 2 if proj == "qkv_proj"
                 else [mlp_width] * 2)
        return torch.cat([rank_slice(tp, config, part, leaf, piece, mlp_width)
                          for part, piece in zip(parts, tensor.split(sizes))])
    if proj in rows:
        start, end = rows[proj]
        return tensor[start:end]
    if proj in columns:  # partial sums, added up by the all-reduce: the bias counts once
        start, end = columns[proj]
        return tensor[:, start:end] if leaf == "weight" else tensor * (tp.rank == 0)
    if leaf == "sinks":  # GPT-OSS's, one per query head
        return tensor[heads.q_start : heads.q_start + heads.num_heads]
    if proj in ("embed_tokens", "lm_head"):  # the rank's range of the vocabulary, padded with zeros
        shard = tp.vocab_shard(config.vocab_size)
        part = tensor[tp.rank * shard : (tp.rank + 1) * shard]
        return F.pad(part, (0, 0, 0, shard - part.shape[0]))
    return tensor


def granite_factor(config: PretrainedConfig, name: str, tied: bool) -> float:
    """What Granite's multipliers make of tensor `name`, folded in as it loads so that the layers run
    as Llama's: the embedding times embedding_multiplier; each layer's o and down projections (weight
    and bias) times residual_multiplier, the scale of what they add to the residual stream; the final
    norm divided by logits_scaling, and by embedding_multiplier where the LM head is the embedding."""
    if name == "model.embed_tokens.weight":
        return config.embedding_multiplier
    if name.endswith(("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight",
                      "mlp.down_proj.bias")):
        return config.residual_multiplier
    if name == "model.norm.weight":
        return 1 / (config.logits_scaling * (config.embedding_multiplier if tied else 1))
    return 1.0


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up projection's output: one Triton kernel on CUDA."""
    if on_triton(gate_up) and gate_up.dim() == 2:
        from hyperserve.layers import triton_elementwise

        return triton_elementwise.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_layout(config: PretrainedConfig) -> tuple[int, int, bool]:
    """A layer's cache per token: (K/V heads, their width, whether K and V are one tensor).
    DeepSeek's latent attention keeps one vector a token, its key and (its first kv_lora_rank
    values) its value."""
    if config.model_type in LATENT_TYPES:
        return 1, latent_width(config), True
    return config.num_key_value_heads, head_dim_of(config), False
