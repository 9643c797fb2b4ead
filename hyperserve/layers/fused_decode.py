"""Steps of an int4 Llama on the CPU, one native call per decoder layer.

At a few tokens per step a decoder layer is ~20 small PyTorch ops whose dispatch costs more than
their arithmetic: eager decoding of SmolLM2-135M spent half its time outside the matmuls.
`hyperserve::decode_layer` (kernels/cpu_ops.cpp) runs a whole layer (norms, int4 projections,
rotary, the K/V write, paged attention over the block tables, SwiGLU) in one call, in float32,
reading K/V in place. Every token is a row with its own slot, block table and context length, so
one call serves decodes, speculative verification (k + 1 tokens of a sequence, each attending to
those before it) and prefill chunks alike, and a row's numbers do not depend on the rows beside it.

Which steps it takes (`FusedDecode.takes`): where the int4 weights are interleaved (AVX2-only
CPUs, `quantization.interleaves_q41`), every step. There its 8-bit kernels prefill faster than the
dense float32 path, and one path for every token means that a prompt's last tokens, computed here
after a prefix-cache hit, round exactly as they do when the whole prompt is computed: a request
gives the same answer whether its prefix was cached, and whatever ran beside it. Elsewhere
(AVX-512 VNNI: 16-bit activations) only steps of up to QUANTIZED_MAX_ROWS tokens, since larger
ones run faster as dense bfloat16 or float32 matrix products. `FusedDecode.unsupported` says why a model
cannot use it at all.
"""

from __future__ import annotations

import torch

from hyperserve import kernels
from hyperserve.layers.attention import KVCache
from hyperserve.layers.lora import LoRABatch, unwrapped
from hyperserve.layers.quantization import QUANTIZED_MAX_ROWS, Int4Linear


class FusedDecode:
    """Runs steps of `model` (already int4-quantized) through decode_layer."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        config = model.config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.eps = config.rms_norm_eps
        self.scale = model.model.layers[0].self_attn.scale
        self.dtype = model.model.norm.weight.dtype
        self.layers = [self._weights(layer) for layer in model.model.layers]
        self._no_rows = torch.empty(0, dtype=torch.long)
        # int4 weights in the interleaved layout (norms are weights 0 and 3)
        self.every_step = all(w.dim() == 3 for layer in self.layers for w in layer[1:3] + layer[4:])

    def takes(self, num_tokens: int) -> bool:
        """Whether a step of this many tokens runs here (see the module's docstring)."""
        return self.every_step or num_tokens <= QUANTIZED_MAX_ROWS

    @staticmethod
    def unsupported(model: torch.nn.Module, kv_caches: list[KVCache]) -> str | None:
        """Why the fused path cannot run this model (None: it can)."""
        if not kernels.available():
            return "the native CPU kernels are not built"
        if kv_caches[0].quantized:
            return "a quantized KV cache"
        if model.sliding_window is not None:
            return "sliding-window attention"
        if model.tp.size > 1:
            return "tensor parallelism (the layer's output needs an all-reduce before the residual add)"
        for layer in model.model.layers:
            linears = [unwrapped(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                              layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            if not all(isinstance(m, Int4Linear) and m.native and not m.has_bias for m in linears):
                return "projections that are not bias-free native int4"
        return None

    @staticmethod
    def _weights(layer: torch.nn.Module) -> list[torch.Tensor]:
        attn, mlp = layer.self_attn, layer.mlp
        return [layer.input_layernorm.weight.detach().float().contiguous(), unwrapped(attn.qkv_proj).q41,
                unwrapped(attn.o_proj).q41, layer.post_attention_layernorm.weight.detach().float().contiguous(),
                unwrapped(mlp.gate_up_proj).q41, unwrapped(mlp.down_proj).q41]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, lengths: torch.Tensor, kv_caches: list[KVCache],
                 lora: LoRABatch | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] (in the model's dtype, before the final norm) of T tokens, each
        with its cache slot, its sequence's block table (a row of block_tables, padded) and the
        length of context it attends to, itself included; with `lora`, each row's adapter too."""
        hidden = self.model.model.embed_tokens(input_ids).float()
        cos, signed_sin = self.model.model.rotary.cos_sin_for(positions, torch.float32)
        with_lora = lora is not None and bool(lora.adapters)
        rows = lora.rows if with_lora else self._no_rows
        for index, (layer, weights, cache) in enumerate(zip(self.model.model.layers, self.layers, kv_caches)):
            adapters = lora.native(index, layer) if with_lora else []
            torch.ops.hyperserve.decode_layer(hidden, weights, cos, signed_sin, cache.key, cache.value, slots,
                                              block_tables, lengths, cache.block_size, self.num_heads,
                                              self.num_kv_heads, self.eps, self.scale, adapters, rows)
        return hidden.to(self.dtype)
