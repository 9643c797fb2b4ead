"""Single-token steps on CUDA: a Llama-family decoder layer in six kernels, the norms, SwiGLU and
residual adds folded into the GEMVs around them.

A single-stream step reads the weights once; everything else is a fixed cost per kernel. On an
H200 the GEMVs of a Llama-3-8B step ran at 87% of the copy bandwidth and the other kernels added
0.48 ms to their 4.05 (norms 0.15, SiLU 0.05: BENCHMARKS.md, 2026-11-26), which is most of the gap
to 85% of the bandwidth limit. The GEMV (layers/triton_gemv.py) reads its whole input row in every
program anyway, so it can take the norm itself (it sums the row's squares as it streams it and
scales its dot products by 1 / RMS at the end), SwiGLU of a fused gate/up output, and the residual
add in its epilogue. The residual stream is then one tensor, each layer returns it with both adds
done:

    qkv GEMV (input norm) -> rotary + K/V write -> attention -> o GEMV (+ stream)
    -> gate/up GEMV (post-attention norm) -> down GEMV (SwiGLU in, + stream)

Numbers: the adds and SwiGLU round as the separate kernels do; the norm multiplies by its weight
before the dot product and by 1 / RMS after it, so its input is rounded once, before that scale
rather than after (a difference within bfloat16's rounding; in float32 the two paths agree).

`takes` says which steps: one token (single-stream decode) on CUDA in half precision, one rank,
and models whose every layer is a plain Llama layer (rotary, a dense MLP) with bfloat16 or float8
projections (Linear, Fp8Linear: not LoRA-wrapped). Anything else runs the modules as they are.
One token, because the GEMV of more rows holds its input tile for a tensor-core dot, and folding
the norm or SwiGLU into it spills registers: built for an H100/H200 (scripts/cuda_compile_check.py,
sm_90) the 16-row variants take 255 registers and spill at 1,024 and 512 inputs a step, where the
one-row ones take 48-60 and spill nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hyperserve.layers.attention import AttentionMetadata, KVCache
from hyperserve.layers.linear import gemv_takes
from hyperserve.layers.norm import RMSNorm

if TYPE_CHECKING:
    from hyperserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM

ENABLED = True  # benchmarks/gpu.py --unfused-layers turns it off, to time the modules' kernels beside it


def takes(model: LlamaForCausalLM, hidden: torch.Tensor) -> bool:
    """Whether this step's layers run here: hidden [T, hidden] is its embedded input."""
    return (ENABLED and hidden.shape[0] == 1 and gemv_takes(hidden) and model.tp.size == 1
            and all(plain(layer) for layer in model.model.layers))


def plain(layer: LlamaDecoderLayer) -> bool:
    """A Llama layer whose every step fits the six kernels: rotary on (Qwen3's QK norms then run in
    the rotary kernel), a dense MLP, projections that hand the GEMV their operands."""
    from hyperserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    if (type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP
            or type(layer.self_attn) is not LlamaAttention):  # DeepSeek's latent attention
        return False
    attn = layer.self_attn
    projections = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    return (attn.rotary is not None and attn.head_dim & (attn.head_dim - 1) == 0
            and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
            and all(hasattr(p, "gemv_operands") for p in projections))


def forward(layers, cos_sin, hidden: torch.Tensor, kv_caches: list[KVCache],
            meta: AttentionMetadata) -> torch.Tensor:
    """The residual stream after every layer (before the final norm) for the embedded hidden."""
    for layer, kv_cache in zip(layers, kv_caches):
        hidden = layer_forward(layer, cos_sin, hidden, kv_cache, meta)
    return hidden


def layer_forward(layer: LlamaDecoderLayer, cos_sin, stream: torch.Tensor, kv_cache: KVCache,
                  meta: AttentionMetadata) -> torch.Tensor:
    from hyperserve.layers.triton_gemv import gemv

    attn, mlp = layer.self_attn, layer.mlp
    norm = layer.input_layernorm
    qkv = gemv(stream, *attn.qkv_proj.gemv_operands, norm=(norm.weight, norm.eps))
    out = attn.attend(cos_sin, qkv, kv_cache, meta)  # the rotary + K/V write kernel, then attention
    stream = gemv(out.flatten(1), *attn.o_proj.gemv_operands, residual=stream)
    norm = layer.post_attention_layernorm
    gate_up = gemv(stream, *mlp.gate_up_proj.gemv_operands, norm=(norm.weight, norm.eps))
    return gemv(gate_up, *mlp.down_proj.gemv_operands, gated=True, residual=stream)
