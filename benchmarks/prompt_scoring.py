"""What scoring a prompt costs: prefill with prompt_logprobs (every prompt token's log-probability,
as lm-evaluation-harness's loglikelihood requests and `echo` with `logprobs` ask) against plain
prefill, SmolLM2-135M, the default configuration, one request at a time.

Each prompt length runs plain and scored in alternating rounds (a shared VM drifts 10-20% within
minutes); a request is timed from its scheduling to its first token, the fastest of --rounds.
Scoring computes the LM head for every prompt row (49,152 logits each) where plain prefill
computes it for the last one, and reads nothing from the prefix cache.

    python benchmarks/prompt_scoring.py [--prompt-lengths 128 512 2048] [--rounds 3]
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


def prefill_seconds(llm: LLM, prompt: list[int], scored: bool) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0 if scored else None)
    metrics = llm.generate([prompt], params, use_tqdm=False)[0].metrics
    return metrics.first_token_time - metrics.first_scheduled_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(max_model_len=max(args.prompt_lengths) + 16, enable_prefix_caching=False)
    print(f"SmolLM2-135M-Instruct, default configuration. {cpu_header(torch.get_num_threads())}")
    rng = random.Random(0)
    print("\n| prompt tokens | plain prefill tok/s | scored (prompt_logprobs) tok/s | scored / plain |")
    print("|---|---|---|---|")
    for length in args.prompt_lengths:
        best = {False: float("inf"), True: float("inf")}
        for _ in range(args.rounds):
            prompt = [rng.randrange(100, 20_000) for _ in range(length)]
            for scored in (False, True):
                best[scored] = min(best[scored], prefill_seconds(llm, prompt, scored))
        plain, scored = length / best[False], length / best[True]
        print(f"| {length} | {plain:,.0f} | {scored:,.0f} | {scored / plain:.2f} |", flush=True)
    llm.close()


if __name__ == "__main__":
    main()
