"""The fused norm, add, gated activation and rotary + K/V write kernels against PyTorch's ops, in
bfloat16 and float32, at widths no block divides. On the CPU they run under TRITON_INTERPRET=1
(set in conftest); on CUDA, natively."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import DEVICES, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_pytorch(device, dtype, with_residual):
    from hyperserve.layers.triton_elementwise import add_rms_norm

    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(2, 7, 300, generator=generator)[i].to(device, dtype) for i in range(2))
    weight = torch.rand(300, generator=generator).to(device, dtype) + 0.5
    summed = x + residual if with_residual else x
    expected = F.rms_norm(summed.float(), (300,), weight.float(), 1e-6)
    normed, got_sum = add_rms_norm(x, residual if with_residual else None, weight, 1e-6)
    if device == "cuda":
        assert torch.equal(got_sum, summed)  # the residual stream, rounded as PyTorch's add rounds it
    else:  # Triton's interpreter rounds to bfloat16 towards zero: one step at most
        assert torch.allclose(got_sum.float(), summed.float(), rtol=2**-7, atol=0)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert normed.dtype == dtype and (normed.float() - expected).norm() / expected.norm() < tolerance
    wrong = F.rms_norm(summed.float(), (300,), weight.flip(0).float(), 1e-6)
    assert (normed.float() - wrong).norm() / wrong.norm() > 0.1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_add_matches_pytorch(device, dtype):
    """Gemma 3's order: the residual plus the norm of a block's output."""
    from hyperserve.layers.triton_elementwise import rms_norm_add

    generator = torch.Generator().manual_seed(3)
    x, residual = (4 * torch.randn(2, 7, 300, generator=generator)[i].to(device, dtype) for i in range(2))
    weight = torch.rand(300, generator=generator).to(device, dtype) + 0.5
    expected = residual.float() + F.rms_norm(x.float(), (300,), weight.float(), 1e-6)
    got = rms_norm_add(x, residual, weight, 1e-6)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert got.dtype == dtype and (got.float() - expected).norm() / expected.norm() < tolerance
    wrong = x.float() + F.rms_norm(residual.float(), (300,), weight.float(), 1e-6)  # the operands swapped
    assert (got.float() - wrong).norm() / wrong.norm() > 0.1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's e^x: inf, as on CUDA
def test_gated_activations_match_pytorch(device, dtype, activation):
    from hyperserve.layers import triton_elementwise

    act = F.silu if activation == "silu" else lambda t: F.gelu(t, approximate="tanh")
    gate_up = (3 * torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(1))).to(device, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = (act(gate) * up).float()
    got = getattr(triton_elementwise, f"{activation}_and_mul")(gate_up)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert got.shape == (5, 1500) and (got.float() - expected).norm() / expected.norm() < tolerance
    swapped = (act(up) * gate).float()
    assert (got.float() - swapped).norm() / swapped.norm() > 0.1
    other = (F.gelu(gate) if activation == "silu" else F.silu(gate)) * up
    assert (got.float() - other.float()).norm() / expected.norm() > 1e-2  # the activation it was asked for


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("all_heads", [False, True])  # a program per token and head, or per token
@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk_norm"])  # Qwen3's, before the rotation
def test_rotary_and_cache_matches_rotary_embedding_and_the_cache_write(device, dtype, kv_cache_dtype,
                                                                       all_heads, qk_norm, monkeypatch):
    if kv_cache_dtype == "fp8" and device == "cpu":
        pytest.skip("Triton's interpreter casts float32 to float8 wrongly "
                    "(-125.9 to -64, and ties away from even)")
    from transformers import LlamaConfig

    from hyperserve.layers import triton_elementwise
    from hyperserve.layers.attention import KVCache
    from hyperserve.layers.rotary import RotaryEmbedding
    from hyperserve.layers.triton_elementwise import rotary_and_cache

    monkeypatch.setattr(triton_elementwise, "ALL_HEADS_FROM_TOKENS", 1 if all_heads else 10**9)

    num_heads, num_kv_heads, head_dim, tokens = 6, 2, 32, 9
    config = LlamaConfig(hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, rope_theta=10000.0)
    rotary = RotaryEmbedding(config, head_dim, 64)
    rotary.reset_cache()
    rotary.to(device)
    generator = torch.Generator().manual_seed(2)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (3 * torch.randn(tokens, width, generator=generator)).to(device, dtype)  # RMS far from 1
    positions = torch.tensor([0, 1, 2, 3, 17, 18, 40, 41, 63], device=device)
    slots = torch.tensor([5, 6, 7, 8, 30, 31, 2, 3, 47], device=device)
    cos_sin = rotary.cos_sin_for(positions, dtype)
    # the PyTorch path: rotate q and k together, then write k and v at their slots
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)
    qk = qk.unflatten(-1, (-1, head_dim))
    norms = None
    if qk_norm:  # as LlamaAttention's modules do: each head normalised, q and k by weights of their own
        weights = [(0.5 + torch.rand(head_dim, generator=generator)).to(device, dtype) for _ in range(2)]
        norms = (*weights, 1e-6)
        q_part, k_part = qk.split([num_heads, num_kv_heads], dim=1)
        qk = torch.cat([F.rms_norm(q_part, (head_dim,), norms[0], norms[2]),
                        F.rms_norm(k_part, (head_dim,), norms[1], norms[2])], dim=1)
    q_want, k_want = rotary(cos_sin, qk).split([num_heads, num_kv_heads], dim=1)
    want = KVCache.allocate(4, 16, num_kv_heads, head_dim, dtype, kv_cache_dtype, device)
    want.write(slots, k_want, v.unflatten(-1, (-1, head_dim)))
    got = KVCache.allocate(4, 16, num_kv_heads, head_dim, dtype, kv_cache_dtype, device)
    q, k, v_view = rotary_and_cache(qkv, cos_sin, slots, got, num_heads, num_kv_heads, norms)
    # a rounding step apart at most (a fused multiply-add in one, or the interpreter rounding
    # bfloat16 towards zero, rounds some elements the other way)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
    close = lambda a, b: (a.float() - b.float()).norm() <= tolerance * b.float().norm()
    assert close(q, q_want) and close(k, k_want)
    assert torch.equal(v_view, v.unflatten(-1, (-1, head_dim)))
    assert not torch.allclose(q.float(), qkv[:, : num_heads * head_dim].unflatten(-1, (-1, head_dim)).float())
    if kv_cache_dtype == "auto":
        assert close(got.key, want.key) and torch.equal(got.value, want.value)
        return
    # quantized: the same scales and codes as KVCache.write (v exactly; k from its rotation, which
    # may differ by a rounding step, so a code may move by one step of the scale)
    written = torch.zeros(got.key.shape[0], dtype=torch.bool)
    written[slots.cpu()] = True
    for name in ("key", "value", "key_scale", "value_scale"):
        assert getattr(got, name)[~written.to(device)].float().abs().sum() == 0  # nothing else written
    assert torch.equal(got.value.float(), want.value.float())
    assert torch.equal(got.value_scale, want.value_scale)
    k_got, k_want_dequantized = (c.key.float() * c.key_scale.unsqueeze(-1) for c in (got, want))
    assert (k_got - k_want_dequantized).norm() <= 2e-2 * k_want_dequantized.norm()
    assert torch.allclose(got.key_scale, want.key_scale, rtol=2 * tolerance)
