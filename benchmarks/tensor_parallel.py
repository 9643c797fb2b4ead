"""Tensor parallelism on the CPU: decode speed of SmolLM2 on one process and split over two (gloo).

On one machine's cores, TP buys nothing (the ranks share the cores and add collectives); what it
is for is models larger than one device. This measures the cost of the collectives, and counts
the bytes each token moves between ranks:
  per layer, two all-reduces of [tokens, hidden] (after o and after down), plus one for the
  embedding, and an all-gather of [sampled rows, vocab / ranks] logits per rank.

    python benchmarks/tensor_parallel.py [--sizes 1 2] [--configs float32 int4] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.layers.quantization import cpu_flags  # noqa: E402


def decode_tps(size: int, config: str, batch: int) -> tuple[float, float]:
    """(start-up seconds, output tokens/s after the first token) for `batch` greedy streams."""
    options = {"quantization": None} if config == "float32" else {}
    started = time.perf_counter()
    with LLM(tensor_parallel_size=size, max_model_len=1024, kv_cache_memory_gb=0.25, **options) as llm:
        startup = time.perf_counter() - started
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate([list(range(100, 132))], SamplingParams(max_tokens=4), use_tqdm=False)
        outputs = llm.generate([list(range(1000 + 40 * i, 1032 + 40 * i)) for i in range(batch)], params,
                               use_tqdm=False)
        first = min(o.metrics.first_token_time for o in outputs)
        last = max(o.metrics.finished_time for o in outputs)
        return startup, sum(len(o.outputs[0].token_ids) - 1 for o in outputs) / (last - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--configs", nargs="+", default=["float32", "int4"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    rows = [(config, size, batch, *decode_tps(size, config, batch))
            for config in args.configs for size in args.sizes for batch in args.batch]
    flags = cpu_flags()
    print(f"\nCPU flags: avx2={'avx2' in flags} avx512f={'avx512f' in flags} amx={'amx_tile' in flags}; "
          f"{os.cpu_count()} cores\n")
    print("| weights | ranks | streams | start-up s | decode tok/s |")
    print("|---|---|---|---|---|")
    for config, size, batch, startup, tps in rows:
        print(f"| {config} | {size} | {batch} | {startup:.1f} | {tps:.1f} |")
    hidden, layers, vocab = 576, 30, 49152
    for size in args.sizes:
        if size > 1:
            reduce = (2 * layers + 1) * hidden * 4  # float32 partial sums
            gather = vocab // size * 4 * (size - 1)  # the other ranks' logits, per sampled row
            print(f"\n{size} ranks, per token: {reduce / 1024:.0f} KiB all-reduced (each rank sends and receives about "
                  f"that much) and {gather / 1024:.0f} KiB of logits gathered per sampled row")


if __name__ == "__main__":
    main()
