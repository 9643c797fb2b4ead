"""The Triton paged-decode kernel against a plain PyTorch reference: random shapes, block sizes,
GQA ratios, ragged and empty contexts, sliding windows, quantized caches, and split counts.
On the CPU it runs under TRITON_INTERPRET=1 (set in conftest); on CUDA, natively."""

from __future__ import annotations

import math

import pytest
import torch

from hyperserve.layers.attention import KVCache
from tests.conftest import DEVICES, needs_triton

pytestmark = needs_triton


def reference(q, cache: KVCache, tables, context_lens, scale, sliding_window=None):
    """Each sequence's attention over its own context, gathered slot by slot, in float64."""
    out = torch.zeros_like(q, dtype=torch.float64)
    num_heads, num_kv_heads = q.shape[1], cache.key.shape[1]
    for seq, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        first = 0 if sliding_window is None else max(0, length - sliding_window)
        positions = torch.arange(first, length)
        slots = tables[seq, positions // cache.block_size].cpu() * cache.block_size + positions % cache.block_size
        k, v = cache.key[slots.to(cache.key.device)].double(), cache.value[slots.to(cache.key.device)].double()
        if cache.quantized:
            k = k * cache.key_scale[slots].double().unsqueeze(-1)
            v = v * cache.value_scale[slots].double().unsqueeze(-1)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [L, H, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q[seq].double(), k) * scale, dim=-1)
        out[seq] = torch.einsum("hl,lhd->hd", weights, v)
    return out


def random_case(device, *, batch, num_heads, num_kv_heads, head_dim, block_size, dtype, kv_cache_dtype="auto",
                max_len=200, seed=0):
    generator = torch.Generator().manual_seed(seed)
    context_lens = torch.randint(1, max_len + 1, (batch,), generator=generator)
    max_blocks = math.ceil(max_len / block_size) + 1  # tables wider than any context, as padded batches are
    num_blocks = batch * max_blocks + 3
    cache = KVCache.allocate(num_blocks, block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype, device)
    slots = torch.arange(num_blocks * block_size, device=device)
    kv = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, generator=generator).to(device, dtype)
    cache.write(slots, kv[0], kv[1])
    tables = torch.randperm(num_blocks, generator=generator)[: batch * max_blocks].view(batch, max_blocks)
    q = torch.randn(batch, num_heads, head_dim, generator=generator).to(device, dtype)
    return q, cache, tables.to(device), context_lens.to(device)


def run_kernel(q, cache, tables, context_lens, scale, **kwargs):
    from hyperserve.layers.triton_attention import paged_decode_attention

    return paged_decode_attention(q, cache.key, cache.value, tables, context_lens, cache.block_size, scale,
                                  key_scale=cache.key_scale, value_scale=cache.value_scale, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,num_heads,num_kv_heads,head_dim,block_size,num_splits",
    [
        (3, 4, 4, 16, 16, 1),  # multi-head, one split
        (5, 9, 3, 64, 16, 4),  # SmolLM2's GQA 3:1, splits
        (2, 8, 1, 32, 32, 3),  # multi-query, wider blocks
        (4, 32, 8, 128, 16, 7),  # Llama-3-8B's heads; more splits than some contexts have blocks
        (1, 6, 2, 80, 64, 2),  # head_dim not a power of two
    ],
)
def test_matches_reference(device, dtype, batch, num_heads, num_kv_heads, head_dim, block_size, num_splits):
    q, cache, tables, lens = random_case(device, batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                         head_dim=head_dim, block_size=block_size, dtype=dtype, seed=batch)
    scale = head_dim**-0.5
    out = run_kernel(q, cache, tables, lens, scale, num_splits=num_splits)
    atol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's rounding
    torch.testing.assert_close(out.double(), reference(q, cache, tables, lens, scale), atol=atol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_split_count_and_tile_do_not_change_the_result(device):
    q, cache, tables, lens = random_case(device, batch=3, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                                         dtype=torch.float32, max_len=300)
    outs = [run_kernel(q, cache, tables, lens, 0.2, num_splits=n, tile_tokens=tile)
            for n, tile in ((1, 16), (2, 64), (5, 32), (19, 128))]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 17, 40])
def test_sliding_window(device, window):
    q, cache, tables, lens = random_case(device, batch=4, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                                         dtype=torch.float32, max_len=120, seed=window)
    out = run_kernel(q, cache, tables, lens, 0.3, sliding_window=window, num_splits=3)
    torch.testing.assert_close(out.double(), reference(q, cache, tables, lens, 0.3, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_cache(device, dtype, kv_cache_dtype):
    """Codes widened and scaled in registers, for float32 and bfloat16 models."""
    q, cache, tables, lens = random_case(device, batch=3, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                                         dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    out = run_kernel(q, cache, tables, lens, 0.125, num_splits=2)
    atol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's rounding, tf32 dots
    torch.testing.assert_close(out.double(), reference(q, cache, tables, lens, 0.125), atol=atol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_context_gives_zeros_and_writes_into_strided_rows(device):
    """Padding rows of a captured batch have context length 0; the output may be rows of a larger
    tensor (the decode rows of a mixed batch)."""
    q, cache, tables, lens = random_case(device, batch=3, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                                         dtype=torch.float32)
    lens[1] = 0
    full = torch.full((6, 4, 16), 7.0, device=device)
    out = run_kernel(q, cache, tables, lens, 0.25, num_splits=2, out=full[::2])
    assert out.data_ptr() == full.data_ptr()
    torch.testing.assert_close(full[::2].double(), reference(q, cache, tables, lens, 0.25), atol=1e-5, rtol=0)
    assert torch.all(full[2] == 0) and torch.all(full[1::2] == 7.0)
