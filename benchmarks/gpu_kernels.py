"""The decode step's matrix products on a GPU, one Llama-3-8B projection at a time; with
--attention, the paged decode attention kernel instead.

For each projection shape, at 1 and 16 rows: cuBLAS with bfloat16 weights (F.linear), the
float8 path of larger batches (per-token activation scaling, then torch._scaled_mm), and the
Triton GEMV (layers/triton_gemv.py) with bfloat16 and float8 weights at its tiles, which are
then swept at one row (--tiles-json writes each shape's winner, for benchmarks/gpu.py
--gemv-tiles). Each call is timed as the engine runs it, replayed from a CUDA graph (the median
replay of one call per weight copy, the copies together past the L2 cache), so the host's launch
time, which at these sizes is longer than the kernels, is left out; GB/s counts the weight bytes
read once.

--folds times each projection's GEMV with what a decoder layer does before or after it folded in
(layers/gemv_decode.py: the norm, SwiGLU, the residual add) against the GEMV beside those as
kernels of their own, as the layer modules run them, at one row (the engine folds nothing into
larger calls: scripts/cuda_compile_check.py).

--attention times layers/triton_attention.py at Llama-3-8B's heads (32 query, 8 KV, 128 wide,
16-token blocks scattered over the pool) for batches and contexts from one long sequence to an
offline run's hundreds, sweeping the tokens read per iteration, the warps, and the programs per
SM that set the split count, for each --kv-cache-dtype (int8/fp8 caches carry a float32 scale per
token and head); GB/s counts the K/V bytes (codes and scales) read once.

--prefill times one layer's prefill attention for a step's spans (an offline step of 32 new
512-token prompts, chunks after context, one long prompt): the portable backend's path (one SDPA
call per span, context gathered and masked), the CUDA backend's as the engine runs it (new prompts
from FLASH_PREFILL_TOKENS through SDPA, the rest in one launch of layers/triton_attention.py's
kernel), PyTorch's varlen FlashAttention over the same block tables where it takes them, and that
kernel for every span, its row and key tiles, warps and stages swept (PREFILL_SWEEP, or the values
given); where every span is short, also with one query head per tile instead of a KV group's.
Each output is checked against the portable path's; TFLOP/s counts the causal products done.

--rotary times the fused rotary + K/V write (layers/triton_elementwise.py) at one token, a decode
batch and a prefill step, with a program per token and head and with one per token; GB/s counts
the bytes read and written once.

--gemm times the projections at an offline run's decode batches (hundreds of rows, where the
product is compute-bound): F.linear through cuBLAS as PyTorch picks its kernel, the same through
cuBLASLt (torch.backends.cuda.preferred_blas_library), and a Triton tensor-core GEMM at a few
tiles; TFLOP/s counts the products done.

    python benchmarks/gpu_kernels.py [--shapes qkv o ...] [--tiles-json OUT] [--json OUT]
    python benchmarks/gpu_kernels.py --folds [--rows 1] [--json OUT]
    python benchmarks/gpu_kernels.py --attention [--kv-cache-dtype auto fp8] [--num-warps 4 8] [--json OUT]
    python benchmarks/gpu_kernels.py --prefill [--kv-cache-dtype auto fp8] [--json OUT]
    python benchmarks/gpu_kernels.py --rotary [--kv-cache-dtype auto fp8] [--json OUT]
    python benchmarks/gpu_kernels.py --gemm [--rows 256 448 512] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import triton
import triton.language as tl
import triton.runtime.errors
import triton.testing
from torch.nn import functional as F

from hyperserve.layers.quantization import Fp8Linear
from hyperserve.layers.triton_gemv import GemvTiles, gemv

# (name, out features, in features) of Llama-3-8B's decode projections
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]
SWEEP = {"block_n": (8, 16, 32), "block_k": (512, 1024, 2048), "num_warps": (4, 8), "num_stages": (3,)}
ROTATE_BYTES = 512 * 2**20  # weight copies per shape: past H100's 50 MB L2


def timed(fn_for_copy, copies: int) -> float:
    """Median microseconds of one call of fn, from CUDA-graph replays of a call per weight copy."""
    for i in range(copies):  # compiles, and picks cuBLAS's kernels, outside the capture
        fn_for_copy(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn_for_copy(i)
    us = 1e3 * triton.testing.do_bench(graph.replay, warmup=5, rep=25, return_mode="median") / copies
    del graph
    return us


def measure(name: str, n: int, k: int, row_counts: list[int]) -> list[dict]:
    rows = []
    weight = torch.randn(n, k, device="cuda") * 0.02
    bf16_bytes = n * k * 2
    copies = max(2, math.ceil(ROTATE_BYTES / bf16_bytes))
    bf16 = [weight.to(torch.bfloat16).roll(i, 0) for i in range(copies)]
    fp8 = [Fp8Linear(w, None) for w in bf16[: max(2, math.ceil(ROTATE_BYTES / (n * k)))]]
    del weight
    for m in row_counts:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        x17 = torch.randn(17, k, device="cuda", dtype=torch.bfloat16)
        results = {
            "cublas bf16": (timed(lambda i, x=x: F.linear(x, bf16[i]), len(bf16)), bf16_bytes),
            "triton bf16": (timed(lambda i, x=x: gemv(x, bf16[i]), len(bf16)), bf16_bytes),
            "triton fp8": (timed(lambda i, x=x: gemv(x, fp8[i]._weight_t.t(), fp8[i]._scale[0]), len(fp8)),
                           n * k),
        }
        if m == 16:  # the scaled GEMM runs from 17 rows
            results["scaled_mm fp8 (17 rows)"] = (timed(lambda i, x17=x17: fp8[i](x17), len(fp8)), n * k)
        for path, (us, nbytes) in results.items():
            rows.append({"shape": name, "n": n, "k": k, "rows": m, "path": path, "us": us,
                         "gbs": nbytes / us / 1e3})
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for dtype_name, weights, nbytes in (("bf16", bf16, bf16_bytes), ("fp8", fp8, n * k)):
        best = None
        for values in itertools.product(*SWEEP.values()):
            config = dict(zip(SWEEP, values))
            if dtype_name == "bf16":
                fn = lambda i, c=config, w=weights: gemv(x, w[i], tiles=GemvTiles(**c))
            else:
                fn = lambda i, c=config, w=weights: gemv(x, w[i]._weight_t.t(), w[i]._scale[0],
                                                         tiles=GemvTiles(**c))
            try:
                us = timed(fn, len(weights))
            except (triton.runtime.errors.OutOfResources, triton.CompilationError):
                continue
            if best is None or us < best[0]:
                best = (us, config)
        rows.append({"shape": name, "n": n, "k": k, "rows": 1, "path": f"triton {dtype_name} best",
                     "us": best[0], "gbs": nbytes / best[0] / 1e3, "config": best[1],
                     "itemsize": 2 if dtype_name == "bf16" else 1})
    return rows


def measure_folds(name: str, n: int, k: int, row_counts: list[int]) -> list[dict]:
    """A projection as the layer modules run it (its norm or SwiGLU a kernel of its own) against the
    GEMV with them folded in (layers/gemv_decode.py): the norm into qkv and gate/up, the residual add
    into o, SwiGLU and the add into down. The add the modules do in the next norm is the folded
    path's o and down epilogue, so a layer's saving is the sum over the four shapes."""
    from hyperserve.layers.triton_elementwise import add_rms_norm, silu_and_mul

    copies = max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16).mul_(0.02) for _ in range(copies)]
    norm = (torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-5)

    def paths(x: torch.Tensor, stream: torch.Tensor) -> tuple:
        """(as the modules run it, folded) for a weight copy i."""
        if name == "o":
            return lambda i: gemv(x, weights[i]), lambda i: gemv(x, weights[i], residual=stream)
        if name == "down":
            return (lambda i: gemv(silu_and_mul(x), weights[i]),
                    lambda i: gemv(x, weights[i], gated=True, residual=stream))
        return (lambda i: gemv(add_rms_norm(x, stream, *norm)[0], weights[i]),
                lambda i: gemv(x, weights[i], norm=norm))

    rows = []
    for m in row_counts:
        x = torch.randn(m, 2 * k if name == "down" else k, device="cuda", dtype=torch.bfloat16)
        stream = torch.randn(m, n if name in ("o", "down") else k, device="cuda", dtype=torch.bfloat16)
        for path, fn in zip(("as modules", "folded"), paths(x, stream)):
            us = timed(fn, copies)
            rows.append({"shape": name, "n": n, "k": k, "rows": m, "path": f"bf16 {path}", "us": us,
                         "gbs": n * k * 2 / us / 1e3})
    return rows


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out [M, N] = x [M, K] @ w [N, K]^T, row-major, tiles visited in groups of GROUP_M row tiles
    so that a wave's weight tiles are shared through the L2 cache."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :], mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * K + (k0 + offs_k)[None, :], mask=offs_n[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def triton_matmul(x: torch.Tensor, w: torch.Tensor, block_m: int, block_n: int, block_k: int,
                  num_warps: int, num_stages: int) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _matmul_kernel[grid](x, w, out, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                         num_warps=num_warps, num_stages=num_stages)
    return out


# (block_m, block_n, block_k, num_warps, num_stages)
MATMUL_TILES = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (64, 256, 64, 4, 4),
                (128, 128, 64, 4, 4), (128, 64, 64, 4, 4)]


def measure_gemm(name: str, n: int, k: int, row_counts: list[int]) -> list[dict]:
    """F.linear through cuBLAS and cuBLASLt, and the Triton GEMM's best tile, at each row count."""
    copies = max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16).mul_(0.02) for _ in range(copies)]
    rows = []
    for m in row_counts:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        reference = F.linear(x, weights[0]).float()
        results = {}
        for library in ("cublas", "cublaslt"):
            previous = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library(library)
            results[library] = (timed(lambda i, x=x: F.linear(x, weights[i]), copies), "")
            torch.backends.cuda.preferred_blas_library(previous)
        best = None
        for tiles in MATMUL_TILES:
            try:
                error = (triton_matmul(x, weights[0], *tiles).float() - reference).abs().max().item()
                us = timed(lambda i, x=x, t=tiles: triton_matmul(x, weights[i], *t), copies)
            except (triton.runtime.errors.OutOfResources, triton.CompilationError):
                continue
            if best is None or us < best[0]:
                best = (us, f"{tiles} max err {error:.3f}")
        if best is not None:
            results["triton best"] = best
        for path, (us, config) in results.items():
            rows.append({"shape": name, "n": n, "k": k, "rows": m, "path": path, "us": us,
                         "tflops": 2 * m * n * k / us / 1e6, "config": config})
            print(f"{name:<9}{m:>5}  {path:<14}{us:>9.1f}{rows[-1]['tflops']:>9.0f}  {config}", flush=True)
    return rows


def measure_rotary(tokens: int, kv_cache_dtype: str) -> list[dict]:
    """rotary_and_cache at Llama-3-8B's heads, a program per token and head against one per token."""
    from hyperserve.layers import triton_elementwise
    from hyperserve.layers.attention import KVCache

    heads, kv_heads, dim, device = 32, 8, 128, torch.device("cuda")
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=device, dtype=torch.bfloat16)
    cos_sin = tuple(torch.randn(tokens, 1, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
    cache = KVCache.allocate(tokens // 16 + 1, 16, kv_heads, dim, torch.bfloat16, kv_cache_dtype, device)
    slots = torch.randperm(cache.key.shape[0], device=device)[:tokens]
    cache_bytes = 2 * tokens * kv_heads * dim * cache.key.element_size()
    nbytes = qkv.numel() * 2 + tokens * (heads + kv_heads) * dim * 2 + cache_bytes
    rows, default = [], triton_elementwise.ALL_HEADS_FROM_TOKENS
    for name, threshold in (("a program a head", 10**9), ("a program a token", 1)):
        triton_elementwise.ALL_HEADS_FROM_TOKENS = threshold
        fn = lambda: triton_elementwise.rotary_and_cache(  # noqa: E731
            qkv, cos_sin, slots, cache, heads, kv_heads)
        us = 1e3 * triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")
        rows.append({"tokens": tokens, "kv": kv_cache_dtype, "path": name, "us": us, "gbs": nbytes / us / 1e3,
                     "shipped": (tokens >= default) == (threshold == 1)})
        print(f"{tokens:>7}{kv_cache_dtype:>6}  {name:<20}{us:>9.1f}{rows[-1]['gbs']:>8.0f}"
              f"{'  shipped' if rows[-1]['shipped'] else ''}", flush=True)
    triton_elementwise.ALL_HEADS_FROM_TOKENS = default
    return rows


ATTENTION_CASES = [(1, 2048), (64, 640), (512, 640)]  # (batch, context tokens)
ATTENTION_SWEEP = {"tile_tokens": (16, 64, 128), "num_warps": (4, 8), "programs_per_sm": (2, 8)}


def measure_attention(batch: int, context: int, kv_cache_dtype: str) -> list[dict]:
    from hyperserve.layers import triton_attention
    from hyperserve.layers.attention import KVCache

    heads, kv_heads, dim, block = 32, 8, 128, 16
    blocks_per_seq = context // block
    num_blocks = batch * blocks_per_seq
    cache = KVCache.allocate(num_blocks, block, kv_heads, dim, torch.bfloat16, kv_cache_dtype,
                             torch.device("cuda"))
    slots = torch.arange(num_blocks * block, device="cuda")
    # written in slices: the float32 quantization's temporaries stay small
    for start in range(0, len(slots), 65536):
        part = slots[start : start + 65536]
        cache.write(part, *torch.randn(2, len(part), kv_heads, dim, device="cuda", dtype=torch.bfloat16))
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size()
                 for t in (cache.key, cache.value, cache.key_scale, cache.value_scale)
                 if t is not None)
    rows = []
    for values in itertools.product(*ATTENTION_SWEEP.values()):
        config = dict(zip(ATTENTION_SWEEP, values))
        splits = triton_attention.num_splits_for(batch, kv_heads, blocks_per_seq, q.device,
                                                 config["programs_per_sm"])
        fn = lambda c=config, splits=splits: triton_attention.paged_decode_attention(
            q, cache.key, cache.value, tables, lens, block, dim**-0.5, key_scale=cache.key_scale,
            value_scale=cache.value_scale, num_splits=splits, tile_tokens=c["tile_tokens"],
            num_warps=c["num_warps"])
        us = 1e3 * triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")
        rows.append({"kv": kv_cache_dtype, "batch": batch, "context": context, **config, "us": us,
                     "gbs": nbytes / us / 1e3})
    return rows


# (new tokens, cached context tokens) of each span in one step
PREFILL_CASES = {"32 x 512 new": [(512, 0)] * 32, "8 x 512 after 1,536": [(512, 1536)] * 8,
                 "1 x 8,192 new": [(8192, 0)], "mixed": [(2048, 0), (1000, 3000), (37, 500), (512, 0)] * 2,
                 # short spans, where a tile holds a KV group's heads: verify spans, cache hits' last tokens
                 "64 x 5 after 600": [(5, 600)] * 64, "448 x 1 after 511": [(1, 511)] * 448}
PREFILL_SWEEP = {"block_m": (64, 128), "block_n": (64, 128), "num_warps": (4, 8), "num_stages": (2, 3)}


def measure_prefill(case: str, spans: list[tuple[int, int]], kv_cache_dtype: str) -> list[dict]:
    from hyperserve.layers.attention import (
        FLASH_PREFILL_TOKENS,
        AttentionMetadata,
        KVCache,
        PrefillBatch,
        PrefillSpan,
        TorchPagedAttention,
        TritonPagedAttention,
        allowed_keys,
    )
    from hyperserve.layers.triton_attention import PrefillTiles, paged_prefill_attention

    heads, kv_heads, dim, block, device = 32, 8, 128, 16, torch.device("cuda")
    tables = []
    for new, context in spans:
        start = sum(len(t) for t in tables)
        tables.append(list(range(start, start + math.ceil((new + context) / block))))
    num_blocks = sum(len(t) for t in tables)
    order = torch.randperm(num_blocks).tolist()  # blocks scattered over the pool
    tables = [[order[b] for b in t] for t in tables]
    cache = KVCache.allocate(num_blocks, block, kv_heads, dim, torch.bfloat16, kv_cache_dtype, device)
    slots = torch.arange(num_blocks * block, device=device)
    cache.write(slots, *torch.randn(2, len(slots), kv_heads, dim, device=device, dtype=torch.bfloat16))
    num_rows = sum(new for new, _ in spans)
    q, k, v = (torch.randn(num_rows, n, dim, device=device, dtype=torch.bfloat16)
               for n in (heads, kv_heads, kv_heads))
    starts = [sum(new for new, _ in spans[:i]) for i in range(len(spans))]
    new_slots = [table[p // block] * block + p % block for (new, context), table in zip(spans, tables)
                 for p in range(context, context + new)]
    cache.write(torch.tensor(new_slots, device=device), k, v)  # as the layer writes them before attending

    def as_spans(which: list[int]) -> list[PrefillSpan]:
        """The portable backend's spans: context gathered and masked where there is some."""
        out = []
        for i in which:
            (new, context), row = spans[i], starts[i]
            mask = allowed_keys(torch.arange(context, context + new), torch.arange(context + new), None)
            out.append(PrefillSpan(row, row + new, None, None) if context == 0 else
                       PrefillSpan(row, row + new, torch.tensor(tables[i], device=device), mask.to(device)))
        return out

    def as_batch(which: list[int]) -> PrefillBatch | None:
        if not which:
            return None
        return PrefillBatch.of([starts[i] for i in which], [spans[i][0] for i in which],
                               [spans[i][1] for i in which], [tables[i] for i in which], device)

    everything = list(range(len(spans)))
    flash = [i for i in everything if spans[i][1] == 0 and spans[i][0] >= FLASH_PREFILL_TOKENS]
    engine_meta = AttentionMetadata(slots[:0], [], as_spans(flash), None,
                                    as_batch([i for i in everything if i not in flash]))
    portable_meta = AttentionMetadata(slots[:0], [], as_spans(everything))
    batch = as_batch(everything)
    scale = dim**-0.5
    flops = sum(4 * dim * heads * (new * context + new * (new + 1) / 2) for new, context in spans)
    expected = TorchPagedAttention()(q, k, v, cache, portable_meta, scale, kv_written=True)
    base = {"case": case, "kv": kv_cache_dtype, "spans": len(spans), "rows": num_rows}
    out = torch.empty_like(q)
    rows = []

    def time_path(path: str, fn, **extra) -> None:
        """One row: fn's largest difference from the portable path's output, and its median time."""
        error = (fn().float() - expected.float()).abs().max().item()
        us = 1e3 * triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")
        rows.append({**base, "path": path, **extra, "us": us, "tflops": flops / us / 1e6, "error": error})

    def kernel(**options):
        """The Triton kernel over every span, with paged_prefill_attention's options."""
        return lambda: paged_prefill_attention(
            q, cache.key, cache.value, batch.block_tables, batch.query_starts, batch.query_lens,
            batch.context_starts, batch.max_query_len, block, scale, out, key_scale=cache.key_scale,
            value_scale=cache.value_scale, **options)

    paths = {"portable (SDPA per span)": (TorchPagedAttention(), portable_meta),
             f"engine (SDPA from {FLASH_PREFILL_TOKENS:,} new)": (TritonPagedAttention(), engine_meta)}
    for name, (backend, meta) in paths.items():
        time_path(name, lambda b=backend, m=meta: b(q, k, v, cache, m, scale, kv_written=True))
    paged_flash = _paged_flash_attention(q, cache, batch, scale)
    if paged_flash is not None:  # PyTorch's FlashAttention over the same pool and block tables
        try:
            time_path("varlen_attn, block table", paged_flash)
        except (RuntimeError, TypeError, ValueError) as failure:  # a block size or dtype it does not take
            print(f"varlen_attn with a block table failed: {str(failure)[:200]}", flush=True)
    for values in itertools.product(*PREFILL_SWEEP.values()):
        config = dict(zip(PREFILL_SWEEP, values))
        try:
            time_path("triton, one launch", kernel(tiles=PrefillTiles(**config)), config=config)
        except (triton.runtime.errors.OutOfResources, triton.CompilationError):
            pass  # tiles this GPU cannot hold
    if batch.max_query_len * heads // kv_heads <= PrefillTiles().block_m:  # the shipped tiles pack heads here
        time_path("triton, a head a tile", kernel(pack_heads=False))
    return rows


def _paged_flash_attention(q, cache, batch, scale):
    """A call of torch.nn.attention.varlen.varlen_attn over the cache's blocks where this PyTorch's
    takes a block table (2.13 does; CUDA only) and the cache is 16-bit; else None. Spans' rows are
    adjacent here, so the cumulative query lengths come from their lengths."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if "block_table" not in inspect.signature(varlen_attn).parameters or cache.quantized:
        print("varlen_attn takes no block table in this PyTorch (or the cache is quantized)", flush=True)
        return None
    pages = lambda t: t.view(-1, cache.block_size, *t.shape[1:])  # noqa: E731
    cu_seq_q = F.pad(batch.query_lens.cumsum(0), (1, 0)).int()
    seen = (batch.context_starts + batch.query_lens).int()  # keys each span's last row sees
    max_k = int(seen.max())
    return lambda: varlen_attn(q, pages(cache.key), pages(cache.value), cu_seq_q, None, batch.max_query_len,
                               max_k, scale=scale, window_size=(-1, 0), enable_gqa=True, seqused_k=seen,
                               block_table=batch.block_tables)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", action="store_true", help="time the paged decode attention instead")
    parser.add_argument("--prefill", action="store_true", help="time the prefill attention paths instead")
    parser.add_argument("--gemm", action="store_true", help="time the projections at decode batches instead")
    parser.add_argument("--rotary", action="store_true", help="time the fused rotary + K/V write instead")
    parser.add_argument("--folds", action="store_true",
                        help="time the GEMV with a layer's norm, SwiGLU or residual add folded in instead")
    parser.add_argument("--kv-cache-dtype", nargs="*", default=["auto"],
                        help="with --attention or --prefill: auto, int8, fp8")
    for name, values in ATTENTION_SWEEP.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, nargs="*", default=list(values),
                            help="with --attention: the values swept")
    for name, values in PREFILL_SWEEP.items():
        parser.add_argument(f"--prefill-{name.replace('_', '-')}", type=int, nargs="*", default=list(values),
                            help="with --prefill: the values swept")
    parser.add_argument("--shapes", nargs="*", default=[name for name, _, _ in SHAPES],
                        help="projections to time")
    parser.add_argument("--rows", type=int, nargs="*", default=None,
                        help="rows to compare the paths at (default 1 16; with --gemm 128 256 384 448 512)")
    parser.add_argument("--tiles-json", default=None, help="write each shape's best tiles here")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}")
    rows = []
    if args.attention:
        ATTENTION_SWEEP.update({name: getattr(args, name) for name in ATTENTION_SWEEP})
        for kv_cache_dtype, (batch, context) in itertools.product(args.kv_cache_dtype, ATTENTION_CASES):
            rows += measure_attention(batch, context, kv_cache_dtype)
            torch.cuda.empty_cache()
        print(f"{'kv':>5}{'batch':>6}{'context':>8}{'tile':>6}{'warps':>6}{'prog/SM':>8}{'us':>9}{'GB/s':>7}")
        for r in rows:
            print(f"{r['kv']:>5}{r['batch']:>6}{r['context']:>8}{r['tile_tokens']:>6}{r['num_warps']:>6}"
                  f"{r['programs_per_sm']:>8}{r['us']:>9.1f}{r['gbs']:>7.0f}")
    elif args.rotary:
        print(f"{'tokens':>7}{'kv':>6}  {'path':<20}{'us':>9}{'GB/s':>8}", flush=True)
        for kv_cache_dtype, tokens in itertools.product(args.kv_cache_dtype, (1, 8, 32, 448, 16384)):
            rows += measure_rotary(tokens, kv_cache_dtype)
    elif args.folds:
        print(f"{'shape':<9}{'rows':>5}  {'path':<18}{'us':>9}{'GB/s':>8}", flush=True)
        for name, n, k in SHAPES:
            if name in args.shapes and name != "lm_head":
                for r in measure_folds(name, n, k, args.rows or [1]):
                    rows.append(r)
                    print(f"{name:<9}{r['rows']:>5}  {r['path']:<18}{r['us']:>9.1f}{r['gbs']:>8.0f}",
                          flush=True)
            torch.cuda.empty_cache()
    elif args.gemm:  # rows printed as each is measured
        print(f"{'shape':<9}{'rows':>5}  {'path':<14}{'us':>9}{'TFLOP/s':>9}  config", flush=True)
        for name, n, k in SHAPES:
            if name in args.shapes:
                rows += measure_gemm(name, n, k, args.rows or [128, 256, 384, 448, 512])
            torch.cuda.empty_cache()
    elif args.prefill:  # rows printed as each case is measured: a part cut short by its timeout keeps them
        PREFILL_SWEEP.update({name: getattr(args, f"prefill_{name}") for name in PREFILL_SWEEP})
        print(f"{'case':<22}{'kv':>5}  {'path':<26}{'us':>9}{'TFLOP/s':>9}{'max err':>9}  config", flush=True)
        for kv_cache_dtype, (case, spans) in itertools.product(args.kv_cache_dtype, PREFILL_CASES.items()):
            measured = measure_prefill(case, spans, kv_cache_dtype)
            torch.cuda.empty_cache()
            for r in measured:
                print(f"{r['case']:<22}{r['kv']:>5}  {r['path']:<26}{r['us']:>9.1f}{r['tflops']:>9.1f}"
                      f"{r['error']:>9.4f}  {r.get('config', '')}", flush=True)
            rows += measured
    else:
        for name, n, k in SHAPES:
            if name in args.shapes:
                rows += measure(name, n, k, args.rows or [1, 16])
            torch.cuda.empty_cache()
        print(f"{'shape':<9}{'rows':>5}  {'path':<26}{'us':>9}{'GB/s':>8}  config")
        for r in rows:
            print(f"{r['shape']:<9}{r['rows']:>5}  {r['path']:<26}{r['us']:>9.1f}{r['gbs']:>8.0f}  "
                  f"{r.get('config', '')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.tiles_json:
        with open(args.tiles_json, "w") as f:
            json.dump([{"n": r["n"], "k": r["k"], "itemsize": r["itemsize"], **r["config"]} for r in rows
                       if "config" in r], f, indent=2)


if __name__ == "__main__":
    main()
