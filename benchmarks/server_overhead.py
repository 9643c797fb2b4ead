"""What the server adds to each token: single-stream decode offline against the same engine behind
`hyperserve serve`, measured in alternating rounds.

Each round runs one request offline (LLM.generate in this process: 32-token prompt, 128 greedy
tokens, ignore_eos; ms per token after the first) and then `hyperserve bench` at concurrency 1 with
the same lengths against the server (ITL p50 and p95, time between streamed chunks as a client sees
it). The server idles while the offline engine runs and the other way round, and alternating makes
a shared VM's drift (10-20% within minutes) fall on both alike. The table gives the medians over the
rounds and the median of each round's ratio. The goal is a server ITL p50 within 10% of offline.

    python benchmarks/server_overhead.py [--configs float32 int4] [--rounds 5] [--server-env OMP_NUM_THREADS=1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quality import engine_options, server_args  # noqa: E402
from benchmarks.serving import start_server  # noqa: E402
from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.bench.run import add_bench_args, run_from_args  # noqa: E402
from hyperserve.layers.quantization import cpu_flags  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402


def offline_ms_per_token(llm: LLM) -> float:
    metrics = llm.generate([list(range(1000, 1032))], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                           use_tqdm=False)[0].metrics
    return 1000 * (metrics.finished_time - metrics.first_token_time) / 127


def server_itl(port: int, num_requests: int) -> dict:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--concurrency", "1", "--num-requests",
                              str(num_requests), "--input-tokens", "32", "--output-tokens", "128"])
    return run_from_args(args)


def measure(config: str, env: dict[str, str], rounds: int) -> list[tuple[float, float, float]]:
    """(offline ms/token, server ITL p50, server ITL p95) of each round."""
    options = dict(kv_cache_memory_gb=1, max_num_batched_tokens=512, **engine_options(config))
    port = free_port()
    server = start_server(port, ["--kv-cache-memory-gb", "1", "--max-num-batched-tokens", "512", *server_args(config)],
                          env=env)
    try:
        llm = LLM(**options)
        llm.generate([list(range(100, 116))], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        server_itl(port, 1)
        results = []
        for round_ in range(rounds):
            offline = offline_ms_per_token(llm)
            summary = server_itl(port, 3)
            results.append((offline, summary["itl_p50_ms"], summary["itl_p95_ms"]))
            print(f"round {round_ + 1}/{rounds}: offline {offline:.2f} ms/token, server ITL p50 "
                  f"{summary['itl_p50_ms']:.2f} ms", flush=True)
        return results
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["float32", "int4"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--server-env", nargs="*", default=[], help="KEY=VALUE for the server process only")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.server_env)
    flags = cpu_flags()
    header = (f"CPU flags: avx2={'avx2' in flags} avx512f={'avx512f' in flags} amx={'amx_tile' in flags}; "
              f"{os.cpu_count()} cores; server env: {env or 'none'}")
    rows = []
    for config in args.configs:
        rounds = measure(config, env, args.rounds)
        offline, p50, p95 = (statistics.median(column) for column in zip(*rounds))
        rows.append((config, offline, p50, p95, statistics.median(s / o for o, s, _ in rounds)))
    print(f"\n{header}; medians of {args.rounds} alternating rounds\n")
    print("| configuration | offline ms/token | server ITL p50 ms | server ITL p95 ms | server / offline |")
    print("|---|---|---|---|---|")
    for config, offline, p50, p95, ratio in rows:
        print(f"| {config} | {offline:.2f} | {p50:.2f} | {p95:.2f} | {ratio:.2f}x |")

if __name__ == "__main__":
    main()
