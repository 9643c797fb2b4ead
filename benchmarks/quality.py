"""Quality guard for weight quantization, and what each configuration buys in speed.

Quality: perplexity of each configuration on a fixed text we wrote (data/quality_text.txt) and how
often its greedy (top-1) token agrees with float32's, position by position over the same text. A
configuration more than 3% worse than float32 in perplexity must not be a default.
Speed, in the same run: single-stream decode (128 tokens), prefill of a 512-token prompt, and
output throughput of 16 requests together (200-token prompts, 128 output tokens each).

    python benchmarks/quality.py [--configs none int8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.engine.model_runner import SeqChunk  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "data" / "quality_text.txt"


def logits_over(llm: LLM, token_ids: list[int], window: int) -> torch.Tensor:
    """Logits [T, V] at every position, in independent windows of `window` tokens (each window
    starts a fresh sequence, so every window's first token has no prediction)."""
    runner, block_size = llm.engine.runner, llm.engine.config.cache.block_size
    rows = []
    for start in range(0, len(token_ids), window):
        ids = token_ids[start:start + window]
        blocks = list(range(-(-len(ids) // block_size)))  # the pool is empty: any blocks will do
        with torch.inference_mode():
            rows.append(runner.forward([SeqChunk(ids, 0, blocks, num_logits=len(ids))]))
    return torch.cat(rows)


def speed(llm: LLM) -> dict:
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    llm.generate([prompt(16)], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    out = llm.generate([prompt(32)], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                       use_tqdm=False)[0].metrics
    decode = 127 / (out.finished_time - out.first_token_time)
    out = llm.generate([prompt(512)], SamplingParams(max_tokens=1), use_tqdm=False)[0].metrics
    prefill = 512 / (out.first_token_time - out.first_scheduled_time)
    start = time.perf_counter()
    llm.generate([prompt(200) for _ in range(16)], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                 use_tqdm=False)
    return {"decode_tok_s": decode, "prefill_tok_s": prefill, "batch16_output_tok_s": 16 * 128 /
            (time.perf_counter() - start)}


def evaluate(quantization: str | None, token_ids: list[int], window: int) -> tuple[float, torch.Tensor, dict]:
    llm = LLM(quantization=quantization, kv_cache_memory_gb=1, max_num_batched_tokens=512)
    logits = logits_over(llm, token_ids, window)
    targets, predicted = [], []
    for start in range(0, len(token_ids), window):
        end = min(start + window, len(token_ids))
        targets += token_ids[start + 1:end]
        predicted += list(range(start, end - 1))
    logprobs = torch.log_softmax(logits[predicted].float(), dim=-1)
    nll = -logprobs[torch.arange(len(targets)), torch.tensor(targets)].mean().item()
    return math.exp(nll), logits[predicted].argmax(-1), speed(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["none", "int8"])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality.json"))
    args = parser.parse_args()
    token_ids = LLM(kv_cache_memory_gb=0.5).tokenizer(TEXT.read_text()).input_ids
    results, reference = {}, None
    for name in args.configs:
        perplexity, top1, timings = evaluate(None if name == "none" else name, token_ids, args.window)
        if reference is None:
            reference = top1
        results[name] = {"perplexity": perplexity, "top1_agreement": (top1 == reference).float().mean().item(),
                         **timings}
    Path(args.out).write_text(json.dumps({"tokens": len(token_ids), "window": args.window, "results": results},
                                         indent=2))
    base = results[args.configs[0]]["perplexity"]
    print(f"\nPerplexity on data/quality_text.txt ({len(token_ids)} tokens, windows of {args.window}), SmolLM2-135M\n")
    print("| weights | perplexity | vs float32 | greedy agreement with float32 | decode tok/s | prefill tok/s "
          "| 16 together, output tok/s |\n|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {'float32' if name == 'none' else name} | {r['perplexity']:.3f} | "
              f"{(r['perplexity'] / base - 1) * 100:+.2f}% | {r['top1_agreement']:.1%} | {r['decode_tok_s']:.1f} | "
              f"{r['prefill_tok_s']:.0f} | {r['batch16_output_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
