"""Prefix caching: a 2,000-token shared system prompt with 16 different short questions.

Time to first token of the first request (cold) and of the 15 after it (warm), one request at a
time; then the throughput of 16 more questions sent together; with the prefix cache on and off,
in one run. SmolLM2-135M on the CPU.

    python benchmarks/prefix_cache.py [--system-tokens 2000] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hyperserve import LLM, SamplingParams  # noqa: E402

QUESTIONS = [
    "What is the boiling point of water?", "Name a prime number above 50.", "Who wrote Hamlet?",
    "What colour is the sky at noon?", "How many legs does a spider have?", "What is 12 times 12?",
    "Name a metal that is liquid at room temperature.", "What is the capital of Japan?",
    "Which planet is the largest?", "How many days are in a leap year?", "What gas do plants absorb?",
    "Name an ocean.", "What is the square root of 81?", "Who painted the Mona Lisa?",
    "What is the freezing point of water in Fahrenheit?", "Name a mammal that can fly.",
]


def system_prompt(llm: LLM, num_tokens: int) -> str:
    rules = [f"Rule {i}: when a question mentions topic {i}, answer plainly, check units, and be brief."
             for i in range(1, 400)]
    text, tokenizer = "", llm.tokenizer
    for rule in rules:
        if len(tokenizer(text + rule).input_ids) > num_tokens:
            break
        text += rule + " "
    return text


def run(enable: bool, args) -> dict:
    llm = LLM(kv_cache_memory_gb=2, max_model_len=4096, enable_prefix_caching=enable)
    system = system_prompt(llm, args.system_tokens)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def prompt(question: str) -> list[int]:
        return llm.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}])

    # Warm up the process (kernels, allocator) on an unrelated prompt of the same length.
    llm.generate([prompt(QUESTIONS[0])[::-1]], SamplingParams(max_tokens=2), use_tqdm=False)
    ttfts = []
    for question in QUESTIONS:  # one at a time: the first is cold, the rest may hit the cache
        output = llm.generate([prompt(question)], params, use_tqdm=False)[0]
        ttfts.append(output.metrics.first_token_time - output.metrics.arrival_time)
    batch = [prompt(q.replace("?", ", briefly?")) for q in QUESTIONS]
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "prompt_tokens": len(batch[0]),
        "cold_ttft": ttfts[0],
        "warm_ttft": statistics.median(ttfts[1:]),
        "batch_seconds": elapsed,
        "batch_output_tok_s": tokens / elapsed,
        "batch_total_tok_s": (tokens + sum(len(p) for p in batch)) / elapsed,
        "hit_rate": llm.engine.kv_cache.num_hit_tokens / max(1, llm.engine.kv_cache.num_queried_tokens),
    }


def run_disk_restart(args) -> dict:
    """The disk tier: one engine computes the prefix, then every cached block is evicted (and so
    spilled to disk); a restarted engine, its pool empty, serves the same prefix from disk."""
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        options = {"kv_cache_memory_gb": 2, "max_model_len": 4096, "disk_cache_dir": directory}
        first = LLM(**options)
        system = system_prompt(first, args.system_tokens)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

        def prompt(llm: LLM, question: str) -> list[int]:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            return llm.apply_chat_template(messages)

        first.generate([prompt(first, QUESTIONS[0])], params, use_tqdm=False)
        kv = first.engine.kv_cache
        kv.pool.allocate(kv.num_free_blocks)  # evict everything cached: it spills to disk
        restarted = LLM(**options)
        restarted.generate([prompt(restarted, QUESTIONS[0])[::-1]], SamplingParams(max_tokens=2), use_tqdm=False)
        output = restarted.generate([prompt(restarted, QUESTIONS[1])], params, use_tqdm=False)[0]
        return {"ttft": output.metrics.first_token_time - output.metrics.arrival_time,
                "disk_tokens": output.metrics.num_disk_cached_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    results = {"on": run(True, args), "off": run(False, args)}
    disk = run_disk_restart(args)
    print(f"\nPrefix caching, SmolLM2-135M, {results['on']['prompt_tokens']}-token prompts "
          f"({args.system_tokens}-token shared system prompt), {args.max_tokens} output tokens\n")
    print("| prefix cache | cold TTFT ms | warm TTFT ms (median of 15) | 16 together: s | output tok/s "
          "| prompt+output tok/s | hit rate |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['cold_ttft'] * 1000:.0f} | {r['warm_ttft'] * 1000:.0f} | {r['batch_seconds']:.1f} | "
              f"{r['batch_output_tok_s']:.1f} | {r['batch_total_tok_s']:.0f} | {r['hit_rate']:.0%} |")
    on = results["on"]
    print(f"\nwarm / cold TTFT with the cache: {on['cold_ttft'] / on['warm_ttft']:.1f}x lower; "
          f"throughput on / off: {on['batch_total_tok_s'] / results['off']['batch_total_tok_s']:.1f}x")
    print(f"disk tier after a restart: TTFT {disk['ttft'] * 1000:.0f} ms with {disk['disk_tokens']} prompt tokens "
          f"loaded from disk (cold, recomputed: {results['off']['cold_ttft'] * 1000:.0f} ms)")


if __name__ == "__main__":
    main()
