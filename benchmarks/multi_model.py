"""Two models in one server: load and reload times, the TTFT of a request that triggers a load,
and throughput of both models served at once against each alone.

`hyperserve serve --model smollm2-135m --model gemma3-270m --on-demand gemma3-270m` (defaults
otherwise: SmolLM2 in int4, Gemma 3 in float32). Throughput: --streams concurrent greedy
completions of --max-tokens tokens per model, alone and with the other model's at the same time.

    python benchmarks/multi_model.py [--streams 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from tests.server.conftest import start_server, stop_server  # noqa: E402

PINNED, ON_DEMAND = "smollm2-135m", "gemma3-270m"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def first_token_s(url: str, model: str) -> float:
    """Seconds from sending a streamed completion to its first token."""
    started, first = time.perf_counter(), None
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():  # to the end: the request is finished when this returns
            if line.startswith("data: {") and first is None:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("no token came back")
    return first


def throughput(url: str, jobs: list[str], max_tokens: int) -> dict[str, float]:
    """Output tokens per second of each model, its requests all running at once."""
    def run(model: str) -> tuple[str, int, float]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
        return model, response["usage"]["completion_tokens"], time.perf_counter()

    started = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    totals: dict[str, float] = {}
    for model in set(jobs):
        done = [r for r in results if r[0] == model]
        totals[model] = sum(r[1] for r in done) / (max(r[2] for r in done) - started)
    return totals


def rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default="benchmarks/results/multi_model.json")
    args = parser.parse_args()
    print(cpu_header(os.cpu_count()))
    started = time.perf_counter()
    server = start_server("--model", PINNED, "--model", ON_DEMAND, "--on-demand", ON_DEMAND, log_name="multi-model")
    results: dict[str, float] = {"startup_s": time.perf_counter() - started}
    try:
        url, pid = server.url, server.process.pid
        first_token_s(url, PINNED)  # warm
        results["rss_one_model_mb"] = rss_mb(pid)
        results["ttft_loaded_s"] = first_token_s(url, PINNED)
        results["ttft_cold_load_s"] = first_token_s(url, ON_DEMAND)
        results["rss_two_models_mb"] = rss_mb(pid)
        unloaded = httpx.post(f"{url}/v1/models/{ON_DEMAND}/unload", timeout=60).json()
        assert unloaded.get("loaded") is False, unloaded
        results["rss_after_unload_mb"] = rss_mb(pid)
        results["ttft_reload_s"] = first_token_s(url, ON_DEMAND)
        for model in (PINNED, ON_DEMAND):
            results[f"{model} alone tok/s"] = throughput(url, [model] * args.streams, args.max_tokens)[model]
        both = throughput(url, [PINNED, ON_DEMAND] * args.streams, args.max_tokens)
        for model in (PINNED, ON_DEMAND):
            results[f"{model} together tok/s"] = both[model]
    finally:
        stop_server(server)
    for name, value in results.items():
        print(f"{name:<32}{value:>10.2f}")
    Path(args.json).write_text(json.dumps({"machine": cpu_header(os.cpu_count()), "args": vars(args),
                                           "results": results}, indent=2))


if __name__ == "__main__":
    main()
