"""Build the engine's Triton kernels for a CUDA GPU on a machine without one, and print what each
variant costs in registers and spills.

Triton's wheel carries NVIDIA's assembler (ptxas), so a kernel compiles to a cubin for an
architecture without a device: a kernel that does not compile, or spills registers to local
memory (the slow path a fused kernel can fall into), shows here, before a GPU session spends its
time finding out. Registers and spills come from the cubin itself (cuobjdump). Nothing runs.

    python scripts/cuda_compile_check.py [--arch 90] [--kernels gemv gemv-folds rotary elementwise attention]
        [--no-spills] [--engine-only]

A kernel that does not compile fails the run; with --no-spills, so does a spill in a variant the
engine runs (column `engine`; the others, such as the 16-row folds the engine does not run, are
there for comparison). What spills depends on Triton's version: run it with the GPU's (a wheel of
it on PYTHONPATH) to see what that GPU runs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def types_of(fn, **pointers: str) -> dict[str, str]:
    """Triton types of fn's arguments: pointers to bfloat16 unless `pointers` says otherwise, `eps`,
    `scale` and `softcap` float32, every other scalar (sizes, strides) int32."""
    floats = ("eps", "scale", "softcap")
    return {name: pointers.get(name, "*bf16") if name.endswith("_ptr") else "fp32" if name in floats
            else "i32" for name in fn.arg_names}


def build(fn, types: dict[str, str], constexprs: dict, arch: int, **options) -> bytes:
    """fn's cubin for sm_<arch>, its runtime arguments typed by `types` (Triton's "*bf16", "i32"...)."""
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).asm["cubin"]


def usage(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, local-memory stores and loads: the spills) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        resources, sass = (subprocess.run([BIN / "cuobjdump", flag, f.name], capture_output=True, text=True,
                                          check=True).stdout for flag in ("-res-usage", "-sass"))
    return int(re.search(r"REG:(\d+)", resources).group(1)), len(re.findall(r"\b(?:STL|LDL)\b", sass))


def gemv_variants(folds: bool):
    """The GEMV at each Llama-3-8B projection's shipped tiles (triton_gemv.tiles_for), 1 and 16 rows;
    with folds, as layers/gemv_decode.py runs it (one row) and at 16 rows for comparison."""
    from hyperserve.layers.triton_gemv import _gemv_kernel, tiles_for

    # (projection, out features, in features, what the six-kernel layer folds into it)
    shapes = [("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "add"), ("gate_up", 28672, 4096, "norm"),
              ("down", 4096, 14336, "swiglu+add")]
    for weights, itemsize in (("bf16", 2), ("fp8e4nv", 1)):
        types = types_of(_gemv_kernel, w_ptr=f"*{weights}", scale_ptr="*fp32")
        for name, n, k, fold in shapes:
            for rows in (1, 16):
                tiles = tiles_for(n, k, itemsize, rows)
                mode = fold if folds else "plain"
                constexprs = dict(HAS_SCALE=itemsize == 1, HAS_BIAS=False, NORM=mode == "norm",
                                  GATED=mode == "swiglu+add", RESIDUAL=mode.endswith("add"), BLOCK_M=rows,
                                  BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, NATIVE_DOT=True)
                engine = rows == 1 or not folds  # the engine folds into one-row GEMVs only
                yield (f"gemv {name} {weights}, {mode}, {rows} rows ({tiles.block_n} x {tiles.block_k}, "
                       f"{tiles.num_warps} warps)", engine, _gemv_kernel, types, constexprs,
                       dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))


def rotary_variants():
    from hyperserve.layers.triton_elementwise import _rotary_and_cache_kernel

    for cache, bound in (("bf16", 0), ("fp8e4nv", 448.0), ("i8", 127.0)):
        types = types_of(_rotary_and_cache_kernel, slots_ptr="*i64", key_cache_ptr=f"*{cache}",
                         value_cache_ptr=f"*{cache}", key_scale_ptr="*fp32", value_scale_ptr="*fp32")
        for qk_norm in (False, True):
            # a program a head, or all of Llama-3-8B's 48 a token (half with QK norms into a quantized cache)
            for heads in (1, 24 if qk_norm and bound else 48):
                constexprs = dict(NUM_HEADS=32, NUM_KV_HEADS=8, D=128, HEADS=heads,
                                  BLOCK_H=triton.next_power_of_2(heads), BOUND=bound, ROUND=cache == "i8",
                                  QK_NORM=qk_norm)
                name = f"rotary+cache {cache} cache, {'QK norms, ' if qk_norm else ''}{heads} heads a program"
                options = dict(num_warps=1 if heads == 1 else 8)
                yield name, True, _rotary_and_cache_kernel, types, constexprs, options


def elementwise_variants():
    from hyperserve.layers import triton_elementwise as kernels

    for gelu in (False, True):
        yield (f"{'gelu_tanh' if gelu else 'silu'}_and_mul", True, kernels._gated_kernel,
               types_of(kernels._gated_kernel), dict(N=14336, BLOCK=1024, GELU=gelu), dict(num_warps=4))
    yield ("rms_norm_add", True, kernels._rms_norm_add_kernel, types_of(kernels._rms_norm_add_kernel),
           dict(N=4096, BLOCK=4096), dict(num_warps=4))
    yield ("add_rms_norm", True, kernels._add_rms_norm_kernel, types_of(kernels._add_rms_norm_kernel),
           dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True), dict(num_warps=4))


def attention_pointers(cache: str) -> dict[str, str]:
    """The attention kernels' pointer types for a cache of Triton type `cache`."""
    return dict(k_cache_ptr=f"*{cache}", v_cache_ptr=f"*{cache}", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                block_tables_ptr="*i32", context_lens_ptr="*i32", query_starts_ptr="*i32",
                query_lens_ptr="*i32", context_starts_ptr="*i32", partial_out_ptr="*fp32",
                partial_lse_ptr="*fp32")


def attention_variants():
    """The paged decode (split) and prefill kernels at Llama-3-8B's heads (32 query, 8 KV, 128
    wide, 16-token blocks) as the engine launches them, bfloat16 and fp8 caches; prefill with one
    head a tile and with a KV group's four packed into it (short spans); at Gemma 2 2B's (8
    query, 4 KV, 256 wide), its scores soft-capped and windowed; and at gpt-oss-20b's (64 query, 8
    KV, 64 wide), windowed, with its attention sinks (the decode's in the merge of its splits)."""
    from hyperserve.layers import triton_attention as kernels

    tl = triton.language
    decode, prefill = kernels._decode_split_kernel, kernels._prefill_kernel
    for cache in ("bf16", "fp8e4nv"):
        quantized = cache != "bf16"
        pointers = attention_pointers(cache)
        yield (f"decode split {cache} cache ({kernels.TILE_TOKENS} tokens a step)", True, decode,
               types_of(decode, **{k: v for k, v in pointers.items() if k in decode.arg_names}),
               dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16,
                    BLOCKS_PER_TILE=kernels.TILE_TOKENS // 16, NUM_SPLITS=16, QUANTIZED=quantized,
                    WINDOWED=False, SOFTCAPPED=False,
                    DOT_DTYPE=tl.float32 if quantized else tl.bfloat16, PRECISION="tf32"), dict(num_warps=4))
        tiles = kernels.prefill_tiles(2, 128)
        for pack in (1, 4):
            yield (f"prefill {cache} cache, {pack} head{'s' * (pack > 1)} a tile ({tiles.block_m} x "
                   f"{tiles.block_n})", True, prefill,
                   types_of(prefill, **{k: v for k, v in pointers.items() if k in prefill.arg_names}),
                   dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=tiles.block_m,
                        BLOCK_N=tiles.block_n, QUANTIZED=quantized, WINDOWED=False, SOFTCAPPED=False,
                        DOT_DTYPE=tl.bfloat16,  # quantized K/V are scaled, then cast to it
                        PRECISION="tf32", PACK=pack, QUERY_ROWS=tiles.block_m // pack, SINKS=False),
                   dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    pointers = attention_pointers("bf16")
    yield ("decode split bf16 cache, Gemma 2 (256 wide, soft-capped)", True, decode,
           types_of(decode, **{k: v for k, v in pointers.items() if k in decode.arg_names}),
           dict(GROUP=2, BLOCK_G=16, HEAD_DIM=256, BLOCK_D=256, BLOCK_SIZE=16,
                BLOCKS_PER_TILE=kernels.TILE_TOKENS // 16, NUM_SPLITS=16, QUANTIZED=False, WINDOWED=True,
                SOFTCAPPED=True, DOT_DTYPE=tl.bfloat16, PRECISION="tf32"), dict(num_warps=4))
    tiles = kernels.prefill_tiles(2, 256)
    yield (f"prefill bf16 cache, Gemma 2 (256 wide, soft-capped; {tiles.block_m} x {tiles.block_n})", True,
           prefill, types_of(prefill, **{k: v for k, v in pointers.items() if k in prefill.arg_names}),
           dict(GROUP=2, HEAD_DIM=256, BLOCK_D=256, BLOCK_SIZE=16, BLOCK_M=tiles.block_m,
                BLOCK_N=tiles.block_n, QUANTIZED=False, WINDOWED=True, SOFTCAPPED=True, DOT_DTYPE=tl.bfloat16,
                PRECISION="tf32", PACK=1, QUERY_ROWS=tiles.block_m, SINKS=False),
           dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    yield ("decode split bf16 cache, GPT-OSS (64 wide, group of 8, windowed)", True, decode,
           types_of(decode, **{k: v for k, v in pointers.items() if k in decode.arg_names}),
           dict(GROUP=8, BLOCK_G=16, HEAD_DIM=64, BLOCK_D=64, BLOCK_SIZE=16,
                BLOCKS_PER_TILE=kernels.TILE_TOKENS // 16, NUM_SPLITS=16, QUANTIZED=False, WINDOWED=True,
                SOFTCAPPED=False, DOT_DTYPE=tl.bfloat16, PRECISION="tf32"), dict(num_warps=4))
    merge = kernels._merge_splits_kernel
    yield ("decode split merge, GPT-OSS's sinks", True, merge,
           types_of(merge, partial_out_ptr="*fp32", partial_lse_ptr="*fp32"),
           dict(NUM_HEADS=64, HEAD_DIM=64, BLOCK_D=64, NUM_SPLITS=16, BLOCK_S=16, SINKS=True),
           dict(num_warps=4))
    tiles = kernels.prefill_tiles(2, 64)
    yield (f"prefill bf16 cache, GPT-OSS (64 wide, windowed, sinks; {tiles.block_m} x {tiles.block_n})", True,
           prefill, types_of(prefill, **{k: v for k, v in pointers.items() if k in prefill.arg_names}),
           dict(GROUP=8, HEAD_DIM=64, BLOCK_D=64, BLOCK_SIZE=16, BLOCK_M=tiles.block_m,
                BLOCK_N=tiles.block_n, QUANTIZED=False, WINDOWED=True, SOFTCAPPED=False,
                DOT_DTYPE=tl.bfloat16, PRECISION="tf32", PACK=1, QUERY_ROWS=tiles.block_m, SINKS=True),
           dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))


KERNELS = {"gemv": lambda: gemv_variants(False), "gemv-folds": lambda: gemv_variants(True),
           "rotary": rotary_variants, "elementwise": elementwise_variants, "attention": attention_variants}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability: 90 Hopper, 80 Ampere")
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--no-spills", action="store_true",
                        help="fail where a variant the engine runs spills")
    parser.add_argument("--engine-only", action="store_true", help="leave out the variants for comparison")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm_{args.arch}")
    print(f"{'variant':<62}{'engine':>7}{'registers':>10}{'spills':>8}", flush=True)
    spilled = []
    variants = [variant for group in args.kernels for variant in KERNELS[group]()
                if variant[1] or not args.engine_only]

    def measure(variant) -> tuple[int, int]:
        _, _, fn, types, constexprs, options = variant
        return usage(build(fn, types, constexprs, args.arch, **options))

    # Triton's compiler and ptxas leave the GIL for most of a build: a thread a core
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        for (name, engine, *_), (registers, spills) in zip(variants, pool.map(measure, variants)):
            print(f"{name:<62}{'yes' if engine else 'no':>7}{registers:>10}{spills:>8}", flush=True)
            if spills and engine:
                spilled.append(name)
    if spilled:
        print(f"spills in variants the engine runs: {', '.join(spilled)}")
    return 1 if spilled and args.no_spills else 0


if __name__ == "__main__":
    sys.exit(main())
