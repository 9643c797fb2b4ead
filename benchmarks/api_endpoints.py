"""What each API adds per token: one server streamed through /v1/completions, /v1/chat/completions,
/v1/responses (OpenAI's Responses API) and /v1/messages (Anthropic's), the last two translated onto
chat, in alternating rounds.

Each round runs `hyperserve bench` at concurrency 1 (64-token prompts, 128 greedy tokens,
ignore_eos) against each endpoint in turn, so a shared VM's drift falls on all alike; the table
gives the medians over the rounds.

    python benchmarks/api_endpoints.py [--rounds 4] [--requests 8] [--server-args ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from benchmarks.serving import start_server  # noqa: E402
from hyperserve.bench.run import add_bench_args, run_from_args  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

ENDPOINTS = ("completions", "chat", "responses", "messages")
MEASURES = ("itl_p50_ms", "itl_p95_ms", "ttft_p50_ms", "output_token_throughput")


def bench(port: int, endpoint: str, requests: int) -> dict:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return run_from_args(parser.parse_args([
        "--base-url", f"http://127.0.0.1:{port}", "--model", "smollm2-135m", "--endpoint", endpoint,
        "--concurrency", "1", "--num-requests", str(requests), "--input-tokens", "64", "--output-tokens", "128",
        "--output-spread", "0", "--ignore-eos", "--temperature", "0"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8, help="requests per endpoint and round")
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="flags for hyperserve serve")
    args = parser.parse_args()
    port = free_port()
    server = start_server(port, args.server_args)
    try:
        for endpoint in ENDPOINTS:  # warm up
            bench(port, endpoint, 1)
        rows: dict[str, list[dict]] = {endpoint: [] for endpoint in ENDPOINTS}
        for round_ in range(args.rounds):
            for endpoint in ENDPOINTS:
                summary = bench(port, endpoint, args.requests)
                rows[endpoint].append(summary)
                print(f"round {round_ + 1}/{args.rounds} {endpoint}: ITL p50 {summary['itl_p50_ms']:.2f} ms",
                      flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    import torch

    print(f"\n`hyperserve serve {' '.join(args.server_args)}`. {cpu_header(torch.get_num_threads())}")
    print(f"Medians of {args.rounds} alternating rounds of {args.requests} requests each.\n")
    print("| endpoint | ITL p50 ms | ITL p95 ms | TTFT p50 ms | output tok/s | ITL p50 / chat's |")
    print("|---|---|---|---|---|---|")
    medians = {endpoint: [statistics.median(s[m] for s in summaries) for m in MEASURES]
               for endpoint, summaries in rows.items()}
    for endpoint, (p50, p95, ttft, tps) in medians.items():
        print(f"| {endpoint} | {p50:.2f} | {p95:.2f} | {ttft:.1f} | {tps:.1f} | {p50 / medians['chat'][0]:.3f}x |")


if __name__ == "__main__":
    main()
