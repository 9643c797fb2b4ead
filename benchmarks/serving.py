"""Online serving: `hyperserve bench` against our own server at several concurrencies.

Starts `hyperserve serve` on loopback, runs the load generator at each concurrency (prompts of
about 200 tokens, 128 output tokens, ignore_eos, streaming completions) and prints one table.
Point --base-url at another server (vLLM, llama.cpp's) to measure it the same way instead.

    python benchmarks/serving.py [--concurrency 1 4 16] [--num-requests 32] [--base-url URL]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import httpx

from hyperserve.bench.run import add_bench_args, run_from_args


def start_server(port: int, extra: list[str], command: str = "serve",
                 env: dict[str, str] | None = None, log_path: str | None = None) -> subprocess.Popen:
    """`hyperserve serve` (or `gateway`) on loopback, with `env` added to its environment, once
    its /health answers 200; its output goes to log_path (else nowhere), whose end is in the
    error if the server exits or never answers."""
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    process = subprocess.Popen([sys.executable, "-m", "hyperserve.cli", command, "--port", str(port), *extra],
                               stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    if log_path:
        log.close()  # the child holds its own handle
    for _ in range(600):
        if process.poll() is not None:
            break
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    process.wait()
    tail = "".join(open(log_path).readlines()[-30:]) if log_path else ""
    raise RuntimeError(f"hyperserve {command} did not start (exit code {process.returncode})\n{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency-levels", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--server-args", default="", help="extra flags for hyperserve serve")
    parser.add_argument("--out-dir", default="bench-results")
    parser.add_argument("--requests-per-slot", type=int, default=3,
                        help="requests per level: max(--num-requests, this x concurrency)")
    add_bench_args(parser)
    parser.set_defaults(num_requests=8)
    args = parser.parse_args()
    own_server = args.base_url == "http://127.0.0.1:8000"
    process = None
    if own_server:
        args.base_url = f"http://127.0.0.1:{args.port}"
        process = start_server(args.port, args.server_args.split())
    os.makedirs(args.out_dir, exist_ok=True)
    rows = []
    try:
        for concurrency in args.concurrency_levels:
            run_args = argparse.Namespace(**vars(args))
            run_args.concurrency, run_args.request_rate = concurrency, None
            run_args.num_requests = max(args.num_requests, args.requests_per_slot * concurrency)
            run_args.output_json = os.path.join(args.out_dir, f"serving-c{concurrency}.json")
            run_args.plot = os.path.join(args.out_dir, f"serving-c{concurrency}.png")
            rows.append((concurrency, run_from_args(run_args)))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)

    print(f"\nServing {args.model} at {args.base_url}: ~{args.input_tokens} prompt tokens, "
          f"{args.output_tokens} output tokens\n")
    print("| concurrency | requests | prompt tok | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms "
          "| output tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for concurrency, s in rows:
        print(f"| {concurrency} | {s['num_ok']}/{s['num_requests']} | {s['mean_prompt_tokens']:.0f} | "
              f"{s['ttft_p50_ms']:.0f} | {s['ttft_p95_ms']:.0f} | {s['itl_p50_ms']:.1f} | {s['itl_p95_ms']:.1f} | "
              f"{s['output_token_throughput']:.1f} |")


if __name__ == "__main__":
    main()
