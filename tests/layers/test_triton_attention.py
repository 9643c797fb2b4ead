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
        blocks = tables[seq, positions // cache.block_size].cpu()
        slots = blocks * cache.block_size + positions % cache.block_size
        on_device = slots.to(cache.key.device)
        k, v = cache.key[on_device].double(), cache.value[on_device].double()
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
    kv = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, generator=generator)
    kv = kv.to(device, dtype)
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
    q, cache, tables, lens = random_case(device, batch=3, num_heads=8, num_kv_heads=2, head_dim=32,
                                         block_size=16, dtype=torch.float32, max_len=300)
    outs = [run_kernel(q, cache, tables, lens, 0.2, num_splits=n, tile_tokens=tile)
            for n, tile in ((1, 16), (2, 64), (5, 32), (19, 128))]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 17, 40])
def test_sliding_window(device, window):
    q, cache, tables, lens = random_case(device, batch=4, num_heads=4, num_kv_heads=2, head_dim=32,
                                         block_size=16, dtype=torch.float32, max_len=120, seed=window)
    out = run_kernel(q, cache, tables, lens, 0.3, sliding_window=window, num_splits=3)
    expected = reference(q, cache, tables, lens, 0.3, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_cache(device, dtype, kv_cache_dtype):
    """Codes widened and scaled in registers, for float32 and bfloat16 models."""
    q, cache, tables, lens = random_case(device, batch=3, num_heads=6, num_kv_heads=2, head_dim=64,
                                         block_size=16, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    out = run_kernel(q, cache, tables, lens, 0.125, num_splits=2)
    atol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's rounding, tf32 dots
    torch.testing.assert_close(out.double(), reference(q, cache, tables, lens, 0.125), atol=atol, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_context_gives_zeros_and_writes_into_strided_rows(device):
    """Padding rows of a captured batch have context length 0; the output may be rows of a larger
    tensor (the decode rows of a mixed batch)."""
    q, cache, tables, lens = random_case(device, batch=3, num_heads=4, num_kv_heads=2, head_dim=16,
                                         block_size=16, dtype=torch.float32)
    lens[1] = 0
    full = torch.full((6, 4, 16), 7.0, device=device)
    out = run_kernel(q, cache, tables, lens, 0.25, num_splits=2, out=full[::2])
    assert out.data_ptr() == full.data_ptr()
    torch.testing.assert_close(full[::2].double(), reference(q, cache, tables, lens, 0.25), atol=1e-5, rtol=0)
    assert torch.all(full[2] == 0) and torch.all(full[1::2] == 7.0)


def prefill_case(device, *, query_lens, context_starts, num_heads, num_kv_heads, head_dim, block_size, dtype,
                 kv_cache_dtype="auto", seed=0):
    """Spans of new rows after cached context, their rows spread over a flat batch with other rows
    between them (as decodes sit between a mixed step's prefill chunks)."""
    generator = torch.Generator().manual_seed(seed)
    ends = [start + n for start, n in zip(context_starts, query_lens)]
    max_blocks = math.ceil(max(ends) / block_size) + 1
    num_blocks = len(query_lens) * max_blocks + 3
    q, cache, _, _ = random_case(device, batch=1, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                 head_dim=head_dim, block_size=block_size, dtype=dtype,
                                 kv_cache_dtype=kv_cache_dtype, max_len=num_blocks * block_size - 1,
                                 seed=seed)
    tables = torch.randperm(num_blocks, generator=generator)[: len(query_lens) * max_blocks]
    tables = tables.view(len(query_lens), max_blocks).to(device)
    query_starts, row = [], 2
    for n in query_lens:
        query_starts.append(row)
        row += n + 3
    q = torch.randn(row, num_heads, head_dim, generator=generator).to(device, dtype)
    return q, cache, tables, query_starts


def tiles(block_m: int, block_n: int):
    from hyperserve.layers.triton_attention import PrefillTiles

    return PrefillTiles(block_m, block_n, num_warps=4)


def run_prefill(q, cache, tables, query_starts, query_lens, context_starts, scale, out, **kwargs):
    from hyperserve.layers.triton_attention import paged_prefill_attention

    as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=q.device)  # noqa: E731
    return paged_prefill_attention(q, cache.key, cache.value, tables, as_tensor(query_starts),
                                   as_tensor(query_lens), as_tensor(context_starts), max(query_lens),
                                   cache.block_size, scale, out, key_scale=cache.key_scale,
                                   value_scale=cache.value_scale, **kwargs)


def prefill_reference(q, cache, tables, query_starts, query_lens, context_starts, scale, sliding_window=None):
    """Row r of a span is a decode at position context_start + r over the span's table."""
    rows = [start + r for start, n in zip(query_starts, query_lens) for r in range(n)]
    row_tables = torch.cat([tables[s].expand(n, -1) for s, n in enumerate(query_lens)])
    lens = torch.tensor([c + r + 1 for c, n in zip(context_starts, query_lens) for r in range(n)])
    return rows, reference(q[rows], cache, row_tables, lens, scale, sliding_window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "query_lens,context_starts,num_heads,num_kv_heads,head_dim,block_size,window",
    [
        ([37, 5, 70], [0, 0, 0], 4, 4, 16, 16, None),  # new prompts, one longer than a row tile
        ([9, 33, 1], [40, 0, 17], 9, 3, 64, 16, None),  # SmolLM2's GQA; chunks after context, a 1-row span
        ([80, 20], [100, 3], 32, 8, 128, 16, None),  # Llama-3-8B's heads; a key tile split over the context
        ([50, 12], [30, 0], 6, 2, 80, 32, None),  # head_dim not a power of two, wider blocks
        ([70, 25, 4], [45, 0, 90], 4, 2, 32, 16, 24),  # a sliding window shorter than the spans
        # short spans, a KV group's heads in one 32-row tile: verify spans, a cache hit's last token
        ([1, 5, 8], [40, 100, 17], 8, 2, 32, 16, None),
        ([2, 7], [30, 50], 9, 3, 64, 16, None),  # a group of 3: 10 rows of 3 heads, 2 tile rows unused
        ([3, 6], [45, 90], 4, 2, 32, 16, 24),  # and windowed
    ],
)
def test_prefill_matches_reference(device, dtype, query_lens, context_starts, num_heads, num_kv_heads,
                                   head_dim, block_size, window):
    q, cache, tables, starts = prefill_case(device, query_lens=query_lens, context_starts=context_starts,
                                            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                            block_size=block_size, dtype=dtype,
                                            seed=len(query_lens) + head_dim)
    scale = head_dim**-0.5
    out = torch.full_like(q, 7.0)
    run_prefill(q, cache, tables, starts, query_lens, context_starts, scale, out, sliding_window=window,
                tiles=tiles(32, 32))
    rows, expected = prefill_reference(q, cache, tables, starts, query_lens, context_starts, scale, window)
    atol = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16: its inputs' and the output's rounding
    torch.testing.assert_close(out[rows].double(), expected, atol=atol, rtol=0)
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[rows] = False
    assert torch.all(out[others.to(device)] == 7.0)  # rows outside the spans are left as they were


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_prefill_quantized_cache(device, kv_cache_dtype):
    query_lens, context_starts = [30, 18], [20, 0]
    q, cache, tables, starts = prefill_case(device, query_lens=query_lens, context_starts=context_starts,
                                            num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                                            dtype=torch.float32, kv_cache_dtype=kv_cache_dtype)
    out = run_prefill(q, cache, tables, starts, query_lens, context_starts, 0.125, torch.zeros_like(q),
                      tiles=tiles(16, 32))
    rows, expected = prefill_reference(q, cache, tables, starts, query_lens, context_starts, 0.125)
    torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_tiles_do_not_change_the_result(device):
    query_lens, context_starts = [45, 100], [64, 7]
    q, cache, tables, starts = prefill_case(device, query_lens=query_lens, context_starts=context_starts,
                                            num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                                            dtype=torch.float32)
    outs = [run_prefill(q, cache, tables, starts, query_lens, context_starts, 0.2, torch.zeros_like(q),
                        tiles=tiles(m, n)) for m, n in ((16, 16), (64, 32), (32, 128))]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_short_spans_packed_or_not_agree(device):
    query_lens, context_starts = [1, 6, 3], [50, 9, 0]
    q, cache, tables, starts = prefill_case(device, query_lens=query_lens, context_starts=context_starts,
                                            num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                                            dtype=torch.float32)
    packed, one_head = (run_prefill(q, cache, tables, starts, query_lens, context_starts, 0.2,
                                    torch.zeros_like(q), tiles=tiles(32, 16), pack_heads=pack)
                        for pack in (True, False))
    torch.testing.assert_close(packed, one_head, atol=1e-5, rtol=0)
    assert packed.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_tiles_halve_until_the_launch_fits(device, monkeypatch):
    """A GPU with less shared memory than the default tiles need (an RTX card's 100 KB) gets smaller
    tiles, the same result, and starts from the tiles that fitted next time."""
    from triton.runtime.errors import OutOfResources

    from hyperserve.layers import triton_attention

    kernel, launched = triton_attention._prefill_kernel, []

    class SmallSharedMemory:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["BLOCK_M"])
                if kwargs["BLOCK_M"] * kwargs["BLOCK_N"] > 32 * 32:
                    raise OutOfResources(200_000, 101_376, "shared memory")
                return kernel[grid](*args, **kwargs)
            return launch

    query_lens, context_starts = [40, 9], [20, 0]
    q, cache, tables, starts = prefill_case(device, query_lens=query_lens, context_starts=context_starts,
                                            num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                                            dtype=torch.float32)
    monkeypatch.setattr(triton_attention, "_prefill_kernel", SmallSharedMemory())
    monkeypatch.setattr(triton_attention, "_FITTED", {})
    out = run_prefill(q, cache, tables, starts, query_lens, context_starts, 0.2, torch.zeros_like(q))
    rows, expected = prefill_reference(q, cache, tables, starts, query_lens, context_starts, 0.2)
    torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=0)
    assert launched == [128, 64, 32]
    run_prefill(q, cache, tables, starts, query_lens, context_starts, 0.2, torch.zeros_like(q))
    assert launched[3:] == [32]
    with pytest.raises(OutOfResources):  # tiles asked for are launched as they are
        run_prefill(q, cache, tables, starts, query_lens, context_starts, 0.2, torch.zeros_like(q),
                    tiles=tiles(64, 64))
