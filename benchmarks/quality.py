"""Quality guard for weight quantization, and what each configuration buys in speed.

Quality: perplexity of each configuration on a fixed text we wrote (data/quality_text.txt) and how
often its greedy (top-1) token agrees with float32's, position by position over the same text. A
configuration more than 3% worse than float32 in perplexity must not be a default.
Speed, in the same run: single-stream decode (128 tokens), prefill of a 512-token prompt, and
output throughput of 16 requests together (200-token prompts, 128 output tokens each).

A configuration is its options joined by "+": `float32`, `int8`, `int4`, `mxfp4`, `compile` (torch.compile
the decode step), `kv-int8` / `kv-fp8` (quantized KV cache), e.g. `int4+compile+kv-int8`.

    python benchmarks/quality.py [--configs float32 int8 int4 int4+compile] [--model gemma3-270m]
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
from tqdm import tqdm  # noqa: E402

from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.engine.model_runner import SeqChunk  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "data" / "quality_text.txt"
MAX_MODEL_LEN = 4096  # what the 1 GB pool holds of Gemma 3's 32k context too


def engine_options(config: str) -> dict:
    """`int4+compile+kv-int8`, `int8+dtype-bfloat16` -> LLM keyword arguments."""
    options: dict = {}
    for part in config.split("+"):
        if part in ("int4", "int8", "fp8", "mxfp4"):
            options["quantization"] = part
        elif part == "compile":
            options["compile"] = True
        elif part.startswith("kv-"):
            options["kv_cache_dtype"] = part[3:]
        elif part == "float32":
            options["quantization"] = None  # float32 weights even where a GGUF would default to int4
        elif part.startswith("dtype-"):  # the activations' and the KV cache's
            options["dtype"] = part[6:]
        else:
            raise ValueError(f"unknown configuration part {part!r} in {config!r}")
    return options


def server_args(config: str) -> list[str]:
    """The same configuration as `hyperserve serve` flags."""
    args = []
    for key, value in engine_options(config).items():
        args += [f"--{key.replace('_', '-')}"] + ([] if value is True else ["none" if value is None else str(value)])
    return args


def logits_over(llm: LLM, token_ids: list[int], window: int, step: int) -> torch.Tensor:
    """Logits [T, V] at every position, in independent windows of `window` tokens (each window
    starts a fresh sequence, so every window's first token has no prediction), fed `step` tokens
    per forward: the whole window runs the prefill path, one token the decode path."""
    runner, block_size = llm.engine.runner, llm.engine.config.cache.block_size
    rows = []
    for start in range(0, len(token_ids), window):
        ids = token_ids[start:start + window]
        blocks = list(range(-(-len(ids) // block_size)))  # the pool is empty: any blocks will do
        with torch.inference_mode():
            for pos in range(0, len(ids), step):
                chunk = ids[pos:pos + step]
                rows.append(runner.forward([SeqChunk(chunk, pos, blocks, num_logits=len(chunk))]))
    return torch.cat(rows)


def speed(llm: LLM, decode_only: bool = False) -> dict:
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    llm.generate([prompt(16)], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    out = llm.generate([prompt(32)], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                       use_tqdm=False)[0].metrics
    decode = 127 / (out.finished_time - out.first_token_time)
    if decode_only:
        return {"decode_tok_s": decode}
    out = llm.generate([prompt(512)], SamplingParams(max_tokens=1), use_tqdm=False)[0].metrics
    prefill = 512 / (out.first_token_time - out.first_scheduled_time)
    start = time.perf_counter()
    llm.generate([prompt(200) for _ in range(16)], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                 use_tqdm=False)
    return {"decode_tok_s": decode, "prefill_tok_s": prefill, "batch16_output_tok_s": 16 * 128 /
            (time.perf_counter() - start)}


def evaluate(model: str, config: str, token_ids: list[int], window: int) -> dict:
    """Perplexity through the prefill path and through the decode path (which run different
    kernels when weights are quantized), greedy tokens of the prefill path, and speed."""
    llm = LLM(model, kv_cache_memory_gb=1, max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN,
              **engine_options(config))
    targets, predicted = [], []
    for start in range(0, len(token_ids), window):
        end = min(start + window, len(token_ids))
        targets += token_ids[start + 1:end]
        predicted += list(range(start, end - 1))
    result = {}
    for path, step in (("prefill", window), ("decode", 1)):
        logits = logits_over(llm, token_ids, window, step)[predicted]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        nll = -logprobs[torch.arange(len(targets)), torch.tensor(targets)].mean().item()
        result[f"perplexity_{path}"] = math.exp(nll)
        result[f"top1_{path}"] = logits.argmax(-1)
    return result | speed(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["float32", "int8", "int4", "int4+compile",
                                                         "int4+compile+kv-int8"])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--model", default="smollm2-135m",
                        help="a registered name or a path, as `hyperserve serve` takes")
    parser.add_argument("--text", default=str(TEXT),
                        help="the text to score (data/quality_text_long.txt: ~2,900 tokens, for 8-bit paths, "
                             "whose perplexity a rounding-level change moves by about 1%% on the default's 788)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quality.json"))
    args = parser.parse_args()
    tokenizer = LLM(args.model, kv_cache_memory_gb=0.5, max_model_len=MAX_MODEL_LEN).tokenizer
    token_ids = tokenizer(Path(args.text).read_text()).input_ids
    results, reference = {}, None
    for name in tqdm(args.configs, desc="configurations"):
        result = evaluate(args.model, name, token_ids, args.window)
        reference = result["top1_prefill"] if reference is None else reference
        for path in ("prefill", "decode"):
            result[f"top1_agreement_{path}"] = (result.pop(f"top1_{path}") == reference).float().mean().item()
        results[name] = result
    Path(args.out).write_text(json.dumps({"tokens": len(token_ids), "window": args.window, "results": results},
                                         indent=2))
    base = results[args.configs[0]]
    print(f"\nPerplexity on {Path(args.text).name} ({len(token_ids)} tokens, windows of {args.window}), "
          f"{args.model}; vs {args.configs[0]}; greedy agreement with {args.configs[0]}'s prefill path\n")
    print("| configuration | perplexity, prefill path | perplexity, decode path | greedy agreement, prefill / decode "
          "| decode tok/s | prefill tok/s | 16 together, output tok/s |\n|---|---|---|---|---|---|---|")
    for name, r in results.items():
        ppl = {}
        for path in ("prefill", "decode"):
            value = r[f"perplexity_{path}"]
            ppl[path] = f"{value:.3f} ({(value / base[f'perplexity_{path}'] - 1) * 100:+.2f}%)"
        print(f"| {name} | {ppl['prefill']} | {ppl['decode']} | {r['top1_agreement_prefill']:.1%} / "
              f"{r['top1_agreement_decode']:.1%} | {r['decode_tok_s']:.1f} | {r['prefill_tok_s']:.0f} | "
              f"{r['batch16_output_tok_s']:.1f} |")


if __name__ == "__main__":
    main()
