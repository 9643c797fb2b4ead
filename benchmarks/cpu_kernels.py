"""The native CPU matrix kernel per weight format: one projection's time and the weight bytes it
streams per second, at the row counts of decode steps (1 stream, a few, a verify step's).

Each format's weights are the same random matrix, laid out as the engine lays it out (int4's Q4_1
and mxfp4's MXFP4 in blocks of 8 channels, int8's Q8_0 in blocks of 16). Copies enough to
overflow the caches are taken in turn, so the weights come from memory, as a decode step's do.
`--warm` times the arithmetic instead: one copy that stays in the caches, one thread, the fastest
of many calls, in nanoseconds per row and group of 32 inputs of 8 channels. That is what steps of
many rows (prompts, verify steps, batches) wait on, and it drifts far less on a VM than the memory.

    python benchmarks/cpu_kernels.py [--shape 5760 2880] [--rows 1 4 8 32] [--isa avx2]
    python benchmarks/cpu_kernels.py --warm [--rows 8 16 32]
"""

from __future__ import annotations

import argparse
import time

import torch

from hyperserve import kernels
from hyperserve.layers.quantization import Int4Linear, Mxfp4Linear, Q8Linear, cpu_flags

COPIES_BYTES = 256 * 2**20  # the copies taken in turn: past any L3 of the machines we run on


def packed_weights(out_features: int, in_features: int) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (the kernels' format, the packed weight) of one random matrix."""
    weight = torch.randn(out_features, in_features) * 0.02
    int4 = Int4Linear(weight, None, torch.float32)
    if int4.q41.dim() != 3:
        raise SystemExit("int4 weights are not interleaved on this CPU (no AVX2): nothing to compare")
    return {"int4 (Q4_1)": ("q4_1", int4.q41), "mxfp4": ("mxfp4", Mxfp4Linear(weight, None).mxfp4),
            "int8 (Q8_0)": ("q8_0", Q8Linear(weight, None).q80)}


def seconds_per_call(fmt: str, weight: torch.Tensor, in_features: int, rows: int, isa: str,
                     rounds: int = 5) -> float:
    """Median over rounds of one call's time, each round a pass over copies of the weight."""
    copies = [weight.clone() for _ in range(max(2, COPIES_BYTES // weight.numel()))]
    x = torch.randn(rows, in_features)
    for copy in copies:
        torch.ops.hyperserve.quantized_linear(x, copy, fmt, isa)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for copy in copies:
            torch.ops.hyperserve.quantized_linear(x, copy, fmt, isa)
        times.append((time.perf_counter() - start) / len(copies))
    return sorted(times)[len(times) // 2]


def warm_seconds_per_call(fmt: str, weight: torch.Tensor, in_features: int, rows: int, isa: str) -> float:
    """The fastest of 30 rounds of 10 calls on one copy of the weight, which stays in the caches."""
    x = torch.randn(rows, in_features)
    best = float("inf")
    for _ in range(30):
        start = time.perf_counter()
        for _ in range(10):
            torch.ops.hyperserve.quantized_linear(x, weight, fmt, isa)
        best = min(best, (time.perf_counter() - start) / 10)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs=2, type=int, metavar=("OUT", "IN"),
                        help="out and in features (default: gpt-oss-20b's expert gate_up, 5760 x 2880; "
                             "with --warm 1024 x 1024, which the caches hold)")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 32])
    parser.add_argument("--isa", default="", help="avx2 or portable: a lesser instruction set than the CPU's")
    parser.add_argument("--warm", action="store_true", help="cache-warm, one thread: the arithmetic's cost")
    args = parser.parse_args()
    if not kernels.available():
        raise SystemExit("the native CPU kernels are not built")
    if args.warm:
        torch.set_num_threads(1)
    args.shape = args.shape or ([1024, 1024] if args.warm else [5760, 2880])
    flags = " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
                     if f in cpu_flags())
    print(f"{torch.get_num_threads()} threads; flags: {flags}; kernels: {args.isa or kernels.isa()}; "
          f"weight {args.shape[0]} x {args.shape[1]}\n")
    weights = packed_weights(*args.shape)
    unit = "ns per row and group of 8 channels" if args.warm else "ms (GB/s)"
    print("| rows | " + " | ".join(f"{name} {unit}" for name in weights) + " |")
    print("|---|" + "---|" * len(weights))
    block_groups = args.shape[0] // 8 * args.shape[1] // 32
    for rows in args.rows:
        cells = []
        for fmt, weight in weights.values():
            if args.warm:
                seconds = warm_seconds_per_call(fmt, weight, args.shape[1], rows, args.isa)
                cells.append(f"{seconds / rows / block_groups * 1e9:.2f}")
            else:
                seconds = seconds_per_call(fmt, weight, args.shape[1], rows, args.isa)
                cells.append(f"{seconds * 1e3:.3f} ({weight.numel() / seconds / 1e9:.1f})")
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
