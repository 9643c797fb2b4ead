"""Offline throughput: HyperServe continuous batching vs transformers.generate in static batches.

64 seeded prompts of 100-400 tokens, output lengths drawn from 16-256 (ignore_eos), SmolLM2-135M.
Each system runs in its own process so peak RSS is its own. transformers runs padded static
batches of 16 (left padding, every sequence generating the batch's longest output length);
throughput counts only the tokens each request asked for, for both.

    python benchmarks/offline_throughput.py [--num-prompts 64] [--only hyperserve|transformers]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def workload(num_prompts: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randint(100, 400))] for _ in range(num_prompts)]
    output_lengths = [rng.randint(16, 256) for _ in range(num_prompts)]
    return prompts, output_lengths


def run_hyperserve(prompts, output_lengths, args) -> float:
    from hyperserve import LLM, SamplingParams

    llm = LLM(max_model_len=2048, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory_gb=args.kv_cache_memory_gb)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lengths]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == output_lengths
    return elapsed


def run_transformers(prompts, output_lengths, args) -> float:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from hyperserve.models.registry import resolve_model

    source = resolve_model("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.gguf_file, dtype=torch.float32
    ).eval()
    pad = model.config.pad_token_id or 0
    start = time.perf_counter()
    for i in tqdm(range(0, len(prompts), args.hf_batch_size), desc="transformers batches"):
        batch, lengths = prompts[i : i + args.hf_batch_size], output_lengths[i : i + args.hf_batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(input_ids, attention_mask=mask, max_new_tokens=max(lengths),
                           min_new_tokens=max(lengths), do_sample=False, pad_token_id=pad)
    return time.perf_counter() - start


def child(args) -> None:
    prompts, output_lengths = workload(args.num_prompts)
    runner = run_hyperserve if args.only == "hyperserve" else run_transformers
    elapsed = runner(prompts, output_lengths, args)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {"system": args.only, "seconds": elapsed, "output_tokens": sum(output_lengths),
              "prompt_tokens": sum(len(p) for p in prompts), "peak_rss_mb": peak_rss_mb}
    print("RESULT " + json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="offline: big prefill chunks")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="holds all 64 sequences at once")
    parser.add_argument("--only", choices=["hyperserve", "transformers"])
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--plot", help="also write a PNG bar chart here")
    args = parser.parse_args()
    if args.only:
        return child(args)

    results = []
    for system in ("hyperserve", "transformers"):
        cmd = [sys.executable, __file__, "--only", system] + sys.argv[1:]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        line = next(row for row in proc.stdout.splitlines() if row.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))

    print(f"\nOffline throughput, {args.num_prompts} prompts, SmolLM2-135M, {os.cpu_count()} CPU cores\n")
    print("| system | wall s | output tok/s | total tok/s | peak RSS MB |")
    print("|---|---|---|---|---|")
    for r in results:
        out_tps = r["output_tokens"] / r["seconds"]
        tot_tps = (r["output_tokens"] + r["prompt_tokens"]) / r["seconds"]
        print(f"| {r['system']} | {r['seconds']:.1f} | {out_tps:.1f} | {tot_tps:.1f} | {r['peak_rss_mb']:.0f} |")
    ratio = results[1]["seconds"] / results[0]["seconds"]
    print(f"\nHyperServe / transformers output throughput: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "ratio": ratio}, f, indent=2)
    if args.plot:
        plot(results, args.plot)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["system"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(names, [r["output_tokens"] / r["seconds"] for r in results], color=["tab:green", "tab:gray"])
    axes[0].set(title="Output tokens/s (higher is better)")
    axes[1].bar(names, [r["peak_rss_mb"] for r in results], color=["tab:green", "tab:gray"])
    axes[1].set(title="Peak RSS, MB")
    fig.suptitle("Offline throughput, SmolLM2-135M, 64 prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
