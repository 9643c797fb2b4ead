"""Steps of an int4, int8 or mxfp4 Llama-family, Gemma or GPT-OSS model on the CPU, in native calls:
one per step, or one per layer with LoRA, with layers that do not rotate (SmolLM3's, given cos 1
and sin 0), or with layers that differ (Gemma's and GPT-OSS's: a sliding window on some layers,
each kind with its own rotary table in Gemma 3, norms of attention's and the MLP's outputs, a
GELU-gated MLP, Gemma 2's capped attention scores). Any projection may add a bias (Qwen2's q, k and
v; GPT-OSS's q, k, v, o, router and experts), and GPT-OSS's heads their sinks, its experts their
clamped SwiGLU.

At a few tokens per step a decoder layer is ~20 small PyTorch ops whose dispatch costs more than
their arithmetic: eager decoding of SmolLM2-135M spent half its time outside the matmuls.
`hyperserve::decode_layer` (kernels/cpu_ops.cpp) runs a whole layer (norms, Q4_1 or Q8_0 projections,
Qwen3's per-head QK norms, rotary, the K/V write, paged attention over the block tables, SwiGLU,
or a mixture of experts: the router, each row's top k, each chosen expert once over its rows) in
one call, in float32, reading K/V in place; `decode_layers` runs every layer in one call where no
row has an adapter and the layers are alike (each rotating by one table, none windowed).
The Q8_0 embedding, the final norm and the Q8_0 head run in float32 too (`logits`): as PyTorch
ops in the model's bfloat16 they took 0.2-0.3 ms of a 6 ms token, and the float32 path scores
closer to float32 weights (benchmarks/quality.py). Every token is a row with its own slot, block
table and context length, so one call serves decodes, speculative verification (k + 1 tokens of
a sequence, each attending to those before it) and prefill chunks alike, and a row's numbers do
not depend on the rows beside it.

Which steps it takes (`FusedDecode.takes`): where the weights are interleaved
(`quantization.interleaves_q41`, int8's Q8_0 too) and the CPU has no native bfloat16 (AVX2-only
CPUs), every step. There its integer kernels prefill faster than the dense float32 path, and one
path for every token means that a prompt's last tokens, computed here after a prefix-cache hit,
round exactly as they do when the whole prompt is computed: a request gives the same answer
whether its prefix was cached, and whatever ran beside it. Elsewhere (AMX or AVX-512 BF16) only steps of up to
INTERLEAVED_MAX_ROWS tokens (QUANTIZED_MAX_ROWS in the row layout), since larger ones run faster as
dense bfloat16 matrix products. `FusedDecode.unsupported` says why a model
cannot use it at all.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from hyperserve import kernels
from hyperserve.layers.attention import KVCache, soft_cap
from hyperserve.layers.lora import LoRABatch, unwrapped
from hyperserve.layers.moe import SparseMoE
from hyperserve.layers.quantization import (
    INTERLEAVED_MAX_ROWS,
    Q41_BLOCK_GROUP_BYTES,
    QUANTIZED_MAX_ROWS,
    Int4Linear,
    Mxfp4Linear,
    Q8Embedding,
    Q8Head,
    Q8Linear,
    dense_dtype,
)
from hyperserve.models.deepseek import LatentAttention
from hyperserve.models.gemma import GemmaDecoderLayer
from hyperserve.models.gpt_oss import ClampedSwiGLU

logger = logging.getLogger("hyperserve.fused_decode")


class DecodeRows(NamedTuple):
    """Each token's cache slot [T], its sequence's block table [T, width] (padded) and the length
    of context it attends to, itself included [T], for one pool of layers."""

    slots: torch.Tensor
    block_tables: torch.Tensor
    lengths: torch.Tensor


def packed(linear: torch.nn.Module) -> torch.Tensor | None:
    """A projection's bytes for the native kernels: Int4Linear's Q4_1, Q8Linear's Q8_0, Mxfp4Linear's
    MXFP4 (None: none)."""
    if isinstance(linear, Int4Linear):
        return linear.q41 if linear.native else None
    if isinstance(linear, Mxfp4Linear):
        return linear.mxfp4
    return linear.q80 if isinstance(linear, Q8Linear) else None


def float32(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().float().contiguous()


def optional(weight: torch.Tensor | None) -> torch.Tensor:
    """A weight as decode_layer takes it: packed bytes as they are, else float32; empty where a
    layer has none."""
    if weight is None:
        return torch.empty(0)
    return weight if weight.dtype == torch.uint8 else float32(weight)


# decode_layer's weight slots in order (kernels/decode_layer.h's LayerSlot; an empty tensor where a
# layer has none), then a dense MLP's (a mixture's: its router, its bias, its routing, its experts'
# stacked biases, then each expert's gate_up and down)
LAYER_SLOTS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "mlp_norm", "q_norm", "k_norm", "sinks",
               "attention_out_norm", "mlp_out_norm", "activation")
DENSE_MLP_SLOTS = ("gate_up", "gate_up_bias", "down", "down_bias")

ONE_STREAM_ROWS = 8  # the most rows a pass over a block takes with AVX-512 (kernels' kBlockRowTile)


class FusedDecode:
    """Runs steps of `model` (already int4- or int8-quantized) through decode_layer."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        config = model.config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim
        self.eps = config.rms_norm_eps
        self.scale = model.model.layers[0].self_attn.scale
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.embedding, self.head = model.model.embed_tokens, model.lm_head
        self.embedding_multiplier = model.embedding_multiplier
        self.final_logit_softcap = model.final_logit_softcap
        self.final_norm = model.model.norm.weight.detach().float().contiguous()
        # each layer's rotary table as cos and signed sin of every position, [max_position, head_dim]
        # each: a step indexes them (two ops) rather than building them from the rotary table (eight,
        # 1% of a SmolLM2 step); None: the layer does not rotate
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in model.model.layers:
            rotary = layer.self_attn.rotary
            if rotary is not None and id(rotary) not in tables:
                cos, signed_sin = rotary.cos_sin_for(torch.arange(rotary.max_position), torch.float32)
                tables[id(rotary)] = cos.squeeze(1).contiguous(), signed_sin.squeeze(1).contiguous()
        self.rotary_tables = list(tables.values())
        rotaries = [layer.self_attn.rotary for layer in model.model.layers]
        self.rotary_index = [None if r is None else list(tables).index(id(r)) for r in rotaries]
        self.windows = [model.sliding_window if windowed else 0 for windowed in model.window_layers]
        self.gelu = [isinstance(layer, GemmaDecoderLayer) for layer in model.model.layers]
        self.softcaps = [layer.self_attn.softcap or 0.0 for layer in model.model.layers]  # Gemma 2's
        self.layers = [self._weights(layer) for layer in model.model.layers]
        self._all_layers = [w for layer in self.layers for w in layer]
        # one call for every layer where they are all alike: Llama's, each rotating by one table
        self.uniform = (self.rotary_index == [0] * len(self.layers) and not any(self.windows)
                        and not any(self.gelu) and not any(self.softcaps))
        # weights in the interleaved layouts, on a CPU without a native dense type faster than the
        # 8-bit kernels
        packed = [w for w in self._all_layers if w.dtype == torch.uint8]
        interleaved = all(w.dim() == 3 for w in packed)
        self.every_step = interleaved and dense_dtype() == torch.float32
        self.max_rows = INTERLEAVED_MAX_ROWS if interleaved else QUANTIZED_MAX_ROWS
        int4 = [w for w in packed if w.dim() == 3 and w.shape[2] == Q41_BLOCK_GROUP_BYTES]
        if int4 and interleaved and kernels.isa() == "avx512_vnni":
            self._choose_block_streams(int4)

    @staticmethod
    def _choose_block_streams(weights: list[torch.Tensor]) -> None:
        """Whether AVX-512 steps of a few rows read the interleaved int4 blocks one at a time or in
        pairs: the faster at one row over every layer's weights, timed here (a few passes, tens of
        ms). The two give the same bits. On a Zen 4 EPYC one stream read SmolLM2's layers 39%
        faster; on the Intel Xeon we measure on, pairs led one row of the AVX2 kernel by 20%."""
        # a weight is [blocks, groups, 160]: 32 inputs a group
        inputs = [torch.randn(1, w.shape[1] * 32) for w in weights]

        def seconds(rows: int) -> float:
            torch.ops.hyperserve.set_one_stream_rows(rows)
            start = time.perf_counter()
            for w, x in zip(weights, inputs):
                torch.ops.hyperserve.quantized_linear(x, w, "q4_1")
            return time.perf_counter() - start

        timings = {0: [], ONE_STREAM_ROWS: []}
        for _ in range(4):  # alternating, so that a drift of the machine's speed hits both alike
            for rows, times in timings.items():
                times.append(seconds(rows))
        best = min(timings, key=lambda rows: min(timings[rows]))
        torch.ops.hyperserve.set_one_stream_rows(best)
        logger.info("int4 steps of up to %d rows read %s (one row over the layers: %.2f ms in pairs, "
                    "%.2f ms one block at a time)", ONE_STREAM_ROWS,
                    "one block at a time" if best else "blocks in pairs", 1e3 * min(timings[0]),
                    1e3 * min(timings[ONE_STREAM_ROWS]))

    def takes(self, num_tokens: int) -> bool:
        """Whether a step of this many tokens runs here (see the module's docstring)."""
        return self.every_step or num_tokens <= self.max_rows

    @staticmethod
    def unsupported(model: torch.nn.Module, kv_caches: list[KVCache]) -> str | None:
        """Why the fused path cannot run this model (None: it can)."""
        if not kernels.available():
            return "the native CPU kernels are not built"
        if kv_caches[0].quantized:
            return "a quantized KV cache"
        if model.tp.size > 1:
            return "tensor parallelism (the layer's output needs an all-reduce before the residual add)"
        if any(getattr(layer.mlp, "shared_expert", None) is not None for layer in model.model.layers):
            return "a shared expert (Qwen2-MoE, DeepSeek)"
        if any(isinstance(layer.self_attn, LatentAttention) for layer in model.model.layers):
            return "latent attention (DeepSeek)"
        rotaries = [layer.self_attn.rotary for layer in model.model.layers]
        if any(rotary is not None and rotary.rotary_dim != rotary.head_dim for rotary in rotaries):
            return "a rotation over part of each head (partial_rotary_factor)"
        if not (isinstance(model.model.embed_tokens, Q8Embedding) and isinstance(model.lm_head, Q8Head)):
            return "an embedding or LM head not in Q8_0"
        for layer in model.model.layers:
            mlps = layer.mlp.experts if isinstance(layer.mlp, SparseMoE) else [layer.mlp]
            linears = [unwrapped(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)]
            linears += [unwrapped(m) for mlp in mlps for m in (mlp.gate_up_proj, mlp.down_proj)]
            if not all(isinstance(m, (Int4Linear, Q8Linear, Mxfp4Linear)) and packed(m) is not None
                       for m in linears):
                return "projections that are not native int4, int8 or mxfp4"
            if any(len({unwrapped(getattr(mlp, name)).output_bias is None for mlp in mlps}) > 1
                   for name in ("gate_up_proj", "down_proj")):
                return "experts of which only some have biases"
        return None

    @staticmethod
    def _weights(layer: torch.nn.Module) -> list[torch.Tensor]:
        """The layer's weights as decode_layer takes them, in LAYER_SLOTS' order (Qwen3's q and k
        norms, GPT-OSS's sinks and clamped SwiGLU's alpha and limit, Gemma's norms of attention's
        and the MLP's outputs), then its MLP's."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o = unwrapped(attn.qkv_proj), unwrapped(attn.o_proj)
        gemma = isinstance(layer, GemmaDecoderLayer)
        activation = getattr(mlp.experts[0] if isinstance(mlp, SparseMoE) else mlp, "activation", None)
        slots = {
            "input_norm": layer.input_layernorm.weight, "qkv": packed(qkv), "qkv_bias": qkv.output_bias,
            "o": packed(o), "o_bias": o.output_bias,
            "mlp_norm": (layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm).weight,
            "q_norm": None if attn.q_norm is None else attn.q_norm.weight,
            "k_norm": None if attn.k_norm is None else attn.k_norm.weight,
            "sinks": attn.sinks,
            "attention_out_norm": layer.post_attention_layernorm.weight if gemma else None,
            "mlp_out_norm": layer.post_feedforward_layernorm.weight if gemma else None,
            "activation": (torch.tensor([activation.alpha, activation.limit])
                           if isinstance(activation, ClampedSwiGLU) else None)}
        weights = [optional(slots[name]) for name in LAYER_SLOTS]
        if not isinstance(mlp, SparseMoE):
            gate_up, down = unwrapped(mlp.gate_up_proj), unwrapped(mlp.down_proj)
            dense = {"gate_up": packed(gate_up), "gate_up_bias": gate_up.output_bias, "down": packed(down),
                     "down_bias": down.output_bias}
            return weights + [optional(dense[name]) for name in DENSE_MLP_SLOTS]
        biases = [[unwrapped(getattr(expert, name)).output_bias for expert in mlp.experts]
                  for name in ("gate_up_proj", "down_proj")]
        weights += [float32(mlp.gate.weight), optional(mlp.gate.bias), torch.tensor([mlp.top_k, int(mlp.renormalize)])]
        weights += [torch.empty(0) if b[0] is None else float32(torch.stack(b)) for b in biases]
        return weights + [packed(unwrapped(p)) for expert in mlp.experts
                          for p in (expert.gate_up_proj, expert.down_proj)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: DecodeRows,
                 kv_caches: list[KVCache], lora: LoRABatch | None = None,
                 window_rows: DecodeRows | None = None) -> torch.Tensor:
        """Float32 hidden states [T, hidden] (before the final norm) of T tokens, each with its
        cache slot, its sequence's block table and the length of context it attends to (`rows`;
        `window_rows` for the sliding-window layers where they have a pool of their own); with
        `lora`, each row's adapter too."""
        hidden = self.embedding.lookup(input_ids)
        if self.embedding_multiplier is not None:
            hidden *= self.embedding_multiplier
        rotations = [(cos[positions], signed_sin[positions]) for cos, signed_sin in self.rotary_tables]
        heads = (kv_caches[0].block_size, self.num_heads, self.num_kv_heads, self.eps, self.scale)
        with_lora = lora is not None and bool(lora.adapters)
        if not with_lora and self.uniform:
            keys, values = [c.key for c in kv_caches], [c.value for c in kv_caches]
            torch.ops.hyperserve.decode_layers(hidden, self._all_layers, *rotations[0], keys, values, *rows,
                                               *heads)
            return hidden
        unrotated = None  # cos 1 and sin 0, for layers that do not rotate
        if None in self.rotary_index:
            shape = (len(positions), self.head_dim)
            unrotated = (torch.ones(shape), torch.zeros(shape))
        no_lora = torch.empty(0, dtype=torch.long)
        for index, (layer, weights, cache) in enumerate(zip(self.model.model.layers, self.layers, kv_caches)):
            rotation = unrotated if self.rotary_index[index] is None else rotations[self.rotary_index[index]]
            window = self.windows[index]
            torch.ops.hyperserve.decode_layer(hidden, weights, *rotation, cache.key, cache.value,
                                              *(window_rows if window and window_rows is not None else rows),
                                              *heads, lora.native(index, layer) if with_lora else [],
                                              lora.rows if with_lora else no_lora, window, self.gelu[index],
                                              self.softcaps[index])
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [S, vocab] of final hidden rows [S, hidden]: the final norm, the head, then
        Gemma 2's cap."""
        normed = torch.ops.hyperserve.rms_norm(hidden, self.final_norm, self.eps)
        return soft_cap(self.head(normed)[:, : self.vocab_size], self.final_logit_softcap)
