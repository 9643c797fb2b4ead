"""HyperServe on Ray Serve on this machine: 1 against 2 engine replicas, routing overhead, and the
prefix cache's hit rate with and without prefix affinity.

On a local Ray cluster this script starts (--num-cpus logical CPUs), SmolLM2 with the default
engine configuration, each replica given --replica-cpus CPUs (its engine's threads):
1. throughput and TTFT at concurrency 16 (`hyperserve bench`'s load: ~200-token prompts, 64
   output tokens, streaming) with 1 replica and with 2, and the plain server (all cores) beside;
2. routing overhead: the median end-to-end time of one-token completions sent one at a time,
   through Ray Serve (ingress + handle + replica) against the plain `hyperserve serve`;
3. a shared-prompt workload (8 tenants, each with its own ~300-token system prompt, 6 questions
   each, 4 at a time) on 2 replicas, with prefix affinity and without (least loaded): the share
   of prompt tokens served from the prefix cache.

    python benchmarks/ray_scale.py [--replica-cpus 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_vs_llamacpp import cpu_header  # noqa: E402
from benchmarks.serving import start_server  # noqa: E402
from hyperserve.bench.run import add_bench_args, run_from_args  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

SYSTEM = ("You are the assistant of tenant {tenant}. Their products, policies and tone of voice follow. "
          + "Every answer is short, exact and friendly, and cites the policy it relies on. " * 14)


def deploy(url: str, replicas: int, replica_cpus: float, **options) -> None:
    from ray import serve

    from hyperserve.ray_serve import APP_NAME, RayServeConfig, build

    config = RayServeConfig(min_replicas=replicas, max_replicas=replicas, num_cpus=replica_cpus,
                            engine={"kv_cache_memory_gb": 0.5}, **options)
    serve.run(build(config), name=APP_NAME, route_prefix="/")
    httpx.get(f"{url}/health", timeout=60).raise_for_status()


def load(url: str, concurrency: int, num_requests: int) -> dict:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args(["--base-url", url, "--concurrency", str(concurrency), "--num-requests",
                              str(num_requests), "--output-tokens", "64"])
    return run_from_args(args)


def one_token_latency_ms(url: str, count: int = 40) -> float:
    times = []
    with httpx.Client(timeout=60) as client:
        for i in range(count + 5):
            started = time.perf_counter()
            client.post(f"{url}/v1/completions", json={"prompt": f"Number {i}:", "max_tokens": 1}).raise_for_status()
            times.append(time.perf_counter() - started)
    return statistics.median(times[5:]) * 1000


def shared_prompt_hit_rate(url: str) -> tuple[float, int]:
    """Prompt tokens served from the prefix cache over all prompt tokens; replicas that answered."""
    def ask(job: tuple[int, int]) -> tuple[int, int, str]:
        tenant, question = job
        body = {"messages": [{"role": "system", "content": SYSTEM.format(tenant=tenant)},
                             {"role": "user", "content": f"Question {question}: how do returns work?"}],
                "max_tokens": 8, "temperature": 0}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        usage = reply.json()["usage"]
        return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], reply.headers.get(
            "x-hyperserve-replica", "")

    jobs = [(tenant, question) for question in range(6) for tenant in range(8)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, jobs))
    return sum(c for _, c, _ in answers) / sum(p for p, _, _ in answers), len({r for _, _, r in answers})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-cpus", type=int, default=2, help="logical CPUs of the local Ray cluster")
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--json", default="benchmarks/results/ray_scale.json")
    args = parser.parse_args()
    import ray
    from ray import serve

    header = cpu_header(os.cpu_count())
    print(header)
    results: dict[str, float] = {}

    port = free_port()
    plain = start_server(port, ["--kv-cache-memory-gb", "0.5"])
    try:
        results["plain server: one-token request, median ms"] = one_token_latency_ms(f"http://127.0.0.1:{port}")
        summary = load(f"http://127.0.0.1:{port}", 16, args.num_requests)
        results["plain server (2 threads): output tok/s"] = summary["output_token_throughput"]
        results["plain server (2 threads): TTFT p50 ms"] = summary["ttft_p50_ms"]
    finally:
        plain.terminate()
        plain.wait(timeout=60)

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for replicas in (1, 2):
            deploy(url, replicas, args.replica_cpus)
            if replicas == 1:
                results["Ray Serve, 1 replica: one-token request, median ms"] = one_token_latency_ms(url)
            summary = load(url, 16, args.num_requests)
            results[f"{replicas} replica(s): output tok/s"] = summary["output_token_throughput"]
            results[f"{replicas} replica(s): TTFT p50 ms"] = summary["ttft_p50_ms"]
            results[f"{replicas} replica(s): ITL p50 ms"] = summary["itl_p50_ms"]
        for affinity in (True, False):
            deploy(url, 2, args.replica_cpus, prefix_affinity=affinity)
            rate, used = shared_prompt_hit_rate(url)
            name = "with prefix affinity" if affinity else "least loaded, no affinity"
            results[f"shared prompts, {name}: prefix-cache hit rate"] = rate
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"\nRay Serve, SmolLM2-135M, replicas of {args.replica_cpus:g} CPU\n")
    print("| measure | value |\n|---|---|")
    for name, value in results.items():
        print(f"| {name} | {value:.3f} |" if value < 10 else f"| {name} | {value:.1f} |")
    Path(args.json).write_text(json.dumps({"machine": header, "args": vars(args), "date": time.strftime("%Y-%m-%d"),
                                           "results": results}, indent=2))


if __name__ == "__main__":
    main()
