"""What each row of a forward pass costs: steps of N tokens of one sequence after some context (a
verify step's k + 1 rows, a prefill chunk), and prefill of whole prompts.

A verify step of k drafts is a (k + 1)-row step, so `each row after the first` over a one-row
step is the verify cost that n-gram speculation pays per drafted token (ModelRunner.verify_row_cost
times the same at start-up). Steps run through ModelRunner.forward into the first blocks of an
otherwise idle engine's pool, the fastest of --repeats after a warm-up; prefill is LLM.generate of
a random prompt with one output token, from scheduling to the first token, best of two. Run it
with HYPERSERVE_MAX_ISA=avx2 for the AVX2-only code paths on a CPU that has more.

    python benchmarks/rows_per_step.py [--rows 1 2 5 9 17] [--context 256] [--prompt-lengths 512 2048]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from hyperserve import LLM, SamplingParams  # noqa: E402


def prefill_tps(llm: LLM, length: int, rng: random.Random) -> float:
    best = 0.0
    for _ in range(2):
        prompt = [rng.randrange(100, 20_000) for _ in range(length)]
        metrics = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0].metrics
        best = max(best, length / (metrics.first_token_time - metrics.first_scheduled_time))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9, 17])
    parser.add_argument("--context", type=int, default=256, help="tokens of the sequence before the step's rows")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--prompt-lengths", type=int, nargs="*", default=[512, 2048])
    args = parser.parse_args()
    llm = LLM(max_model_len=max([args.context + max(args.rows), *args.prompt_lengths]) + 16)
    print(f"SmolLM2-135M-Instruct, default configuration. {cpu_header(torch.get_num_threads())}")
    runner = llm.engine.runner
    one = runner.time_step(1, args.context, args.repeats)
    print(f"\n| rows after {args.context} tokens | step ms | each row after the first, ms "
          "| relative to a one-row step |")
    print("|---|---|---|---|")
    for rows in args.rows:
        step = one if rows == 1 else runner.time_step(rows, args.context, args.repeats)
        extra = (step - one) / (rows - 1) if rows > 1 else None
        print(f"| {rows} | {step * 1e3:.2f} | {'' if extra is None else f'{extra * 1e3:.3f}'} "
              f"| {'' if extra is None else f'{extra / one:.3f}'} |", flush=True)
    if args.prompt_lengths:
        rng = random.Random(0)
        prefill_tps(llm, 16, rng)  # warm-up
        print("\n| prompt tokens | prefill tok/s |\n|---|---|")
        for length in args.prompt_lengths:
            print(f"| {length} | {prefill_tps(llm, length, rng):.1f} |", flush=True)
    llm.close()


if __name__ == "__main__":
    main()
