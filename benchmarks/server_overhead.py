"""What the server adds to each token: single-stream decode offline against the same engine behind
`hyperserve serve`, measured in alternating rounds.

Each round runs `hyperserve bench` at concurrency 1 against the server (32-token prompt, 128 greedy
tokens, ignore_eos; ITL p50 and p95, time between streamed chunks as a client sees it) between two
requests offline with the same lengths (LLM.generate in this process; ms per token after the first),
whose mean is the round's offline figure. The server idles while the offline engine runs and the
other way round, and alternating makes a shared VM's drift (10-20% within minutes) fall on both
alike. The table gives the medians over the rounds and the median of each round's ratio. The goal
is a server ITL p50 within 10% of offline.

A non-streamed request to the server in the same rounds (`not streamed`, its decode time from
`Server-Timing`) tells the engine thread's share from the streaming's: the whole server, its event
loop woken every token, but no SSE and no client reading.

    python benchmarks/server_overhead.py [--configs float32 int4] [--rounds 10] [--server-env OMP_NUM_THREADS=1]
        [--compare-server-env KEY=VALUE ...]   # a second server, measured in the same rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.quality import engine_options, server_args  # noqa: E402
from benchmarks.serving import start_server  # noqa: E402
from hyperserve import LLM, SamplingParams  # noqa: E402
from hyperserve.bench.run import add_bench_args, run_from_args  # noqa: E402
from hyperserve.layers.quantization import cpu_flags  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

PROMPT = list(range(1000, 1032))
PARAMS = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)


def ms_per_token(metrics) -> float:
    return 1000 * (metrics.finished_time - metrics.first_token_time) / (PARAMS.max_tokens - 1)


def offline_ms_per_token(llm: LLM) -> float:
    return ms_per_token(llm.generate([PROMPT], PARAMS, use_tqdm=False)[0].metrics)


def not_streamed_ms_per_token(port: int) -> float:
    body = {"prompt": PROMPT, "max_tokens": PARAMS.max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    timing = dict(part.split(";dur=") for part in response.headers["server-timing"].split(", "))
    return float(timing["decode"]) / (PARAMS.max_tokens - 1)


def server_itl(port: int, num_requests: int) -> dict:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--concurrency", "1", "--num-requests",
                              str(num_requests), "--input-tokens", "32", "--output-tokens", "128"])
    return run_from_args(args)


def measure(config: str, envs: list[dict[str, str]], rounds: int) -> list[list[tuple[float, ...]]]:
    """For each round and server env in turn: (offline, not streamed, server ITL p50, server ITL p95),
    milliseconds a token."""
    options = dict(kv_cache_memory_gb=1, max_num_batched_tokens=512, **engine_options(config))
    ports = [free_port() for _ in envs]
    servers = []
    try:
        for port, env in zip(ports, envs):
            servers.append(start_server(port, ["--kv-cache-memory-gb", "1", "--max-num-batched-tokens", "512",
                                               *server_args(config)], env=env))
        llm = LLM(**options)
        llm.generate([list(range(100, 116))], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
        for port in ports:
            server_itl(port, 1)
        results = []
        for round_ in range(rounds):
            row = []
            for port, env in zip(ports, envs):
                before = offline_ms_per_token(llm)
                not_streamed = not_streamed_ms_per_token(port)
                summary = server_itl(port, 3)
                offline = (before + offline_ms_per_token(llm)) / 2  # the VM's drift within the round cancels
                row.append((offline, not_streamed, summary["itl_p50_ms"], summary["itl_p95_ms"]))
                print(f"round {round_ + 1}/{rounds}, server env {env or 'none'}: offline {offline:.2f} ms/token, "
                      f"not streamed {not_streamed:.2f}, "
                      f"server ITL p50 {summary['itl_p50_ms']:.2f} ms", flush=True)
            results.append(row)
        return results
    finally:
        for server in servers:
            server.terminate()
            server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["float32", "int4"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--server-env", nargs="*", default=[], help="KEY=VALUE for the server process only")
    parser.add_argument("--compare-server-env", nargs="*", default=None,
                        help="KEY=VALUE: a second server with this env, measured in the same rounds")
    args = parser.parse_args()
    envs = [dict(item.split("=", 1) for item in args.server_env)]
    if args.compare_server_env is not None:
        envs.append(dict(item.split("=", 1) for item in args.compare_server_env))
    flags = cpu_flags()
    header = (f"CPU flags: avx2={'avx2' in flags} avx512f={'avx512f' in flags} amx={'amx_tile' in flags}; "
              f"{os.cpu_count()} cores")
    rows = []
    for config in args.configs:
        rounds = measure(config, envs, args.rounds)
        for i, env in enumerate(envs):
            measured = [row[i] for row in rounds]
            medians = [statistics.median(column) for column in zip(*measured)]
            # median per-round ratios to offline: not streamed, streamed (ITL p50)
            ratios = [statistics.median(row[k] / row[0] for row in measured) for k in (1, 2)]
            rows.append((config, env, medians, ratios))
    print(f"\n{header}; medians of {args.rounds} alternating rounds "
          "(offline: a request before and after each server's)\n")
    print("| config | server env | offline ms/token | not streamed ms/token | server ITL p50 ms | server ITL p95 ms | "
          "server / offline |")
    print("|---|---|---|---|---|---|---|")
    for config, env, (offline, not_streamed, p50, p95), ratios in rows:
        env_text = " ".join(f"{k}={v}" for k, v in env.items()) or "none"
        print(f"| {config} | {env_text} | {offline:.2f} | {not_streamed:.2f} ({ratios[0]:.2f}x) | {p50:.2f} | "
              f"{p95:.2f} | **{ratios[1]:.2f}x** |")


if __name__ == "__main__":
    main()
