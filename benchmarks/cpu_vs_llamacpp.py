"""HyperServe against llama.cpp on the CPU, same GGUF (SmolLM2-135M-Instruct Q4_1), one run:
single-stream decode tokens/s (128 tokens), prefill tokens/s of a 512-token prompt, and output
throughput of 16 concurrent requests (200-token prompts, 128 output tokens).

Ours: float32 and our best configuration (int4 weights, compiled decode step); decode and prefill
through the engine, the 16 requests through `hyperserve serve` and `hyperserve bench` (as
llama.cpp's figure is its server's). llama.cpp runs
through llama-cpp-python, installed for this benchmark only (`pip install llama-cpp-python`); its
Python API serves one sequence at a time, so its 16 requests run one after another.

    python benchmarks/cpu_vs_llamacpp.py [--configs float32 int4+compile]  (see benchmarks/quality.py)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.quality import engine_options, server_args, speed  # noqa: E402
from benchmarks.serving import start_server  # noqa: E402
from hyperserve import LLM  # noqa: E402
from hyperserve.bench.run import add_bench_args, run_from_args  # noqa: E402
from hyperserve.models.registry import resolve_model  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402


def ours(config: str) -> dict:
    result = speed(LLM(kv_cache_memory_gb=1, max_num_batched_tokens=512, **engine_options(config)))
    port = free_port()
    server = start_server(port, ["--kv-cache-memory-gb", "1", *server_args(config)])
    try:
        parser = argparse.ArgumentParser()
        add_bench_args(parser)
        args = parser.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--concurrency", "16",
                                  "--num-requests", "32", "--input-tokens", "200", "--output-tokens", "128"])
        result["server16_output_tok_s"] = run_from_args(args)["output_token_throughput"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    return result


def llama_cpp(gguf: str) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=2048, n_batch=512, n_threads=os.cpu_count(), verbose=False)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    def generate(tokens: list[int], n: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds for n - 1 tokens after the first)."""
        llm.reset()
        start = time.perf_counter()
        produced, first = 0, None
        for _ in llm.generate(tokens, top_k=1, temp=0.0, reset=True):
            produced += 1
            if first is None:
                first = time.perf_counter()
            if produced == n:
                break
        return first - start, time.perf_counter() - first

    generate(prompt(16), 4)  # warm up
    _, decode_s = generate(prompt(32), 128)
    prefill_s, _ = generate(prompt(512), 1)
    start = time.perf_counter()
    for _ in range(16):
        generate(prompt(200), 128)
    return {"decode_tok_s": 127 / decode_s, "prefill_tok_s": 512 / prefill_s,
            "server16_output_tok_s": 16 * 128 / (time.perf_counter() - start)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["float32", "int4+compile"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_vs_llamacpp.json"))
    args = parser.parse_args()
    source = resolve_model("smollm2-135m")
    results = {"llama.cpp": llama_cpp(str(source.directory / source.gguf_file))}
    for name in args.configs:
        results[f"hyperserve {name}"] = ours(name)
    Path(args.out).write_text(json.dumps(results, indent=2))
    base = results["llama.cpp"]
    print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF, {os.cpu_count()} CPU threads\n")
    print("| system | decode tok/s | prefill tok/s (512) | 16 concurrent, output tok/s |\n|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['decode_tok_s']:.1f} ({r['decode_tok_s'] / base['decode_tok_s']:.2f}x) | "
              f"{r['prefill_tok_s']:.0f} ({r['prefill_tok_s'] / base['prefill_tok_s']:.2f}x) | "
              f"{r['server16_output_tok_s']:.1f} ({r['server16_output_tok_s'] / base['server16_output_tok_s']:.2f}x) |")


if __name__ == "__main__":
    main()
